"""Qwen3-MoE, Qwen2-MoE and Mixtral (runner/models/moe_decoder.py) against transformers on
tiny random checkpoints (helpers/moe_ckpt.py, float32): prefill logits within 1e-4, greedy
tokens equal (vLLM's near-tie rule) on pages of 1 and 16, batched and chunked with staggered
arrivals; one engine run with chunked prefill and a radix hit; NGRAM speculation equal to
plain decoding; what these models do not run is refused by name.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from helpers.compare import assert_tokens_match
from helpers.driver import greedy_in_mode
from helpers.gemma_ckpt import hf_greedy
from helpers.moe_ckpt import ARCH_NAMES, MIXTRAL_WINDOW, MOES, VOCAB, hf_moe, moe_checkpoints
from helpers.runner import forward_logits, make_runner, num_live_requests

PREFILL_ATOL = 1e-4
NEW_TOKENS = 12
PROMPT_LENS = (1, 9, 17, 40)  # the longest crosses Mixtral's window (16) twice


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return moe_checkpoints(str(tmp_path_factory.mktemp("moe")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(paths, prompts) -> dict:
    return {a: hf_greedy(hf_moe(paths[a]), prompts, NEW_TOKENS) for a in MOES}


_runners: dict = {}


def _runner(path: str, page_size: int):
    key = (path, page_size)
    if key not in _runners:
        _runners[key] = make_runner(path, page_size=page_size, max_total_tokens=2048,
                                    context_length=128, max_running_requests=8,
                                    dtype="float32")
    return _runners[key]


@pytest.mark.parametrize("arch", MOES)
def test_model_is_built_as_configured(arch, paths):
    model = _runner(paths[arch], 1).model
    assert type(model).__name__ == "MoeDecoderForCausalLM"
    sparse = [layer.moe is not None for layer in model.layers]
    assert sparse == ([False, True] if arch == "qwen3_moe" else [True, True])
    moe = model.layers[1].moe
    assert (moe.num_experts, moe.top_k) == (8, 2)
    assert (moe.shared is not None) == (arch == "qwen2_moe")
    assert moe.norm_topk_prob == (arch != "qwen2_moe")
    assert model.layer_windows == ([MIXTRAL_WINDOW] * 2 if arch == "mixtral" else None)
    # The CPU GEMMs take the 2-D projections; the experts stay 3-D tensors.
    assert isinstance(moe.gate_up, torch.nn.Parameter)


@pytest.mark.parametrize("arch", MOES)
def test_prefill_logits_match_transformers(arch, paths, prompts):
    hf = hf_moe(paths[arch])
    runner = _runner(paths[arch], 1)
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(forward_logits(runner, prompt), ref, atol=PREFILL_ATOL,
                                   rtol=0)


# (page_size, batch everything together?, prefill chunk size, staggered arrivals?)
MODES = {"p1_batched": (1, True, None, False), "p16_chunk6_staggered": (16, True, 6, True)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", MOES)
def test_greedy_matches_transformers(arch, mode, paths, prompts, references):
    page_size, batched, chunk, staggered = MODES[mode]
    runner = _runner(paths[arch], page_size)
    outs = greedy_in_mode(runner, prompts, NEW_TOKENS, batched, chunk, staggered)
    for i, (ours, (ref_tokens, ref_logits)) in enumerate(zip(outs, references[arch])):
        assert_tokens_match(ours, ref_tokens, ref_logits, label=f"{arch} {mode} prompt {i}")
    assert num_live_requests(runner) == 0


def test_prefix_hit_and_chunked_prefill_match_transformers(paths, prompts):
    """Through the engine (Qwen2-MoE: shared expert): chunks of 16 on pages of 16, then a
    request whose first 32 tokens come from the radix cache; tokens and the first logprob
    equal transformers'."""
    from kvstrata import LLM

    prompt = prompts[-1]
    (ref_tokens, ref_logits), = hf_greedy(hf_moe(paths["qwen2_moe"]), [prompt], 8)
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    with LLM(model_path=paths["qwen2_moe"], skip_tokenizer_init=True, page_size=16,
             chunked_prefill_size=16, max_total_tokens=2048, dtype="float32") as llm:
        llm.generate(input_ids=prompt[:34], sampling_params=greedy)  # caches 32 tokens
        out = llm.generate(input_ids=prompt, sampling_params=greedy)
        llm.engine.check_integrity()
    assert out["meta_info"]["cached_tokens"] >= 32
    assert_tokens_match(out["output_ids"], ref_tokens, ref_logits, label="prefix hit")
    lp, token = out["meta_info"]["output_token_logprobs"][0][:2]
    assert abs(lp - torch.log_softmax(ref_logits[0], -1)[token].item()) < PREFILL_ATOL


def test_ngram_speculation_equals_plain(paths):
    """NGRAM drafts verified through the MoE layers (Qwen3-MoE): tokens and logprobs equal
    plain greedy decoding, and some drafts are accepted."""
    from tests.correctness.test_speculative import (assert_same, drained, greedy, make_llm,
                                                    repeating_prompts)

    prompts, params, path = repeating_prompts()[:4], greedy(16), paths["qwen3_moe"]
    plain = make_llm(path, False, max_total_tokens=2048)
    try:
        ref = plain.generate(input_ids=prompts, sampling_params=params)
    finally:
        plain.shutdown()
    llm = make_llm(path, True, max_total_tokens=2048, page_size=16)
    try:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        assert_same(ref, outs)
        assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0
        drained(llm)
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- what is refused, by name
def test_unsupported_features_are_refused_by_name(paths):
    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.parallel.tp_load import load_tp_shard

    path = paths["mixtral"]
    with pytest.raises(ValueError, match="supports the llama-family decoder only, not "
                                         "MixtralForCausalLM"):
        make_runner(path, quantization="w8a8_int8", max_total_tokens=256)
    with pytest.raises(NotImplementedError, match="deterministic-inference on "
                                                  "MixtralForCausalLM"):
        make_runner(path, enable_deterministic_inference=True, max_total_tokens=256)
    source = resolve_model_path(path)
    with pytest.raises(ValueError, match="tensor parallelism is not implemented for "
                                         "MixtralForCausalLM"):
        load_tp_shard(source, load_hf_config(source), SimpleNamespace(size=2, rank=0))


def test_registry_names_the_moe_architectures():
    from kvstrata.runner.models.registry import arch_spec

    for name in ARCH_NAMES.values():
        assert arch_spec(SimpleNamespace(architectures=[name]))[1].family == "moe"
