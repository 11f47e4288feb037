"""The HTTP request models declare every field of SGLang's request schemas (names as in
sglang/srt/entrypoints/openai/protocol.py and sglang/srt/managers/io_struct.py), and every
field we do not implement is accepted at its off value and refused otherwise."""
from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from kvstrata.entrypoints.api.native_protocol import (SGLANG_SAMPLING_NO_OP,
                                                      SGLANG_SAMPLING_OFF, GenerateRequest,
                                                      native_sampling_dict)
from kvstrata.entrypoints.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvstrata.entrypoints.api.protocol_base import is_off
from kvstrata.protocol import SamplingParams

_SHARED = """model frequency_penalty logit_bias logprobs max_tokens n presence_penalty
    response_format seed stop stream stream_options temperature top_p user
    return_hidden_states return_routed_experts routed_experts_start_len
    return_cached_tokens_details return_token_ids top_k min_p min_tokens regex ebnf
    repetition_penalty stop_token_ids stop_regex no_stop_trim ignore_eos skip_special_tokens
    lora_path session_id session_params custom_params custom_logit_processor images_config
    bootstrap_host bootstrap_port bootstrap_room routed_dp_rank disagg_prefill_dp_rank
    data_parallel_rank rid extra_key cache_salt ngram_corpus_id priority""".split()
SGLANG_CHAT = _SHARED + """messages top_logprobs max_completion_tokens tools tool_choice
    parallel_tool_calls return_prompt_token_ids return_meta_info reasoning_effort task
    continue_final_message separate_reasoning stream_reasoning chat_template_kwargs
    max_dynamic_patch min_dynamic_patch use_audio_in_video input_ids""".split()
SGLANG_COMPLETION = _SHARED + "prompt best_of echo suffix json_schema custom_labels".split()
SGLANG_GENERATE = """rid session_id text input_ids input_embeds image_data video_data
    audio_data mm_hashes mm_content_hashes use_audio_in_video video_config sampling_params
    return_logprob logprob_start_len top_logprobs_num token_ids_logprob return_sampling_mask
    return_text_in_logprobs return_flat_raw_top_logprobs return_flat_raw_top_logprobs_b64
    stream log_metrics return_hidden_states return_routed_experts routed_experts_start_len
    return_indexer_topk modalities session_params lora_path lora_id custom_logit_processor
    positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room
    bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank
    disagg_prefill_dp_rank kv_router_hint routing_key conversation_id http_worker_ipc
    background require_reasoning max_thinking_tokens priority extra_key no_logs custom_labels
    return_bytes return_entropy return_prompt_token_ids external_trace_header received_time
    need_wait_for_mm_inputs num_items_assigned encoder_urls max_dynamic_patch
    min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch images_config
    multi_item_delimiter_indices cache_salt""".split()
SGLANG_SAMPLING = """max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k
    min_p frequency_penalty presence_penalty repetition_penalty min_new_tokens n json_schema
    regex ebnf structural_tag ignore_eos skip_special_tokens spaces_between_special_tokens
    no_stop_trim custom_params stream_interval logit_bias sampling_seed""".split()
REQUIRED = {ChatCompletionRequest: {"messages": [{"role": "user", "content": "x"}]},
            CompletionRequest: {"prompt": "x"}, GenerateRequest: {"text": "x"}}
MODELS = [(ChatCompletionRequest, SGLANG_CHAT), (CompletionRequest, SGLANG_COMPLETION),
          (GenerateRequest, SGLANG_GENERATE)]


@pytest.mark.parametrize("model,sglang_fields", MODELS, ids=lambda m: getattr(m, "__name__", ""))
def test_every_sglang_field_is_declared(model, sglang_fields):
    assert set(sglang_fields) - set(model.model_fields) == set()
    assert model.NOT_IMPLEMENTED <= set(model.model_fields)


@pytest.mark.parametrize("model", list(REQUIRED), ids=lambda m: m.__name__)
def test_every_field_at_its_default_is_accepted(model):
    body = {name: f.default for name, f in model.model_fields.items() if not f.is_required()}
    assert model.first_unimplemented(body) is None
    model.model_validate({**body, **REQUIRED[model]})
    with pytest.raises(ValidationError, match="extra"):
        model.model_validate({**REQUIRED[model], "not_an_sglang_field": 1})


@pytest.mark.parametrize("model", list(REQUIRED), ids=lambda m: m.__name__)
def test_unimplemented_fields_are_refused_when_on(model):
    for name in sorted(model.NOT_IMPLEMENTED):
        on = "x" if model.model_fields[name].default is not True else False
        assert model.first_unimplemented({"stream": False, name: on}) == name
        assert model.first_unimplemented({name: None}) is None


def test_sampling_params_keys_of_sglang():
    ours = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(SGLANG_SAMPLING) - ours - set(SGLANG_SAMPLING_OFF) \
        - SGLANG_SAMPLING_NO_OP == {"sampling_seed"}
    assert native_sampling_dict({"n": 1, "custom_params": None, "sampling_seed": 5}) == {"seed": 5}
    # a no-op with fast tokenizers (SGLang's too): accepted either way, dropped
    assert native_sampling_dict({"spaces_between_special_tokens": False}) == {}
    with pytest.raises(Exception, match="not implemented yet: sampling_params.n"):
        native_sampling_dict({"n": 2})
    with pytest.raises(Exception, match="give one"):
        native_sampling_dict({"seed": 1, "sampling_seed": 2})


def test_is_off_does_not_mix_bools_and_ints():
    assert is_off(None, False) and is_off(False, False) and is_off(0, 0)
    assert not is_off(0, False) and not is_off(1, True) and not is_off(True, 1)
    assert is_off("auto", None, ("none", "auto")) and not is_off("required", None, ("auto",))
