"""Recurrent (SSM / linear-attention) models at start-up: which configs keep state
(config/hf_recurrent.py, read from real transformers config classes' to_dict() and from the
raw config.json spellings checkpoints carry), the resolution rule (config/rules/recurrent.py:
the snapshot strategy, state slots per request, what is refused by name) and the sizing of the
state pool beside the full-attention K/V (config/kv_sizing_state.py)."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import transformers as T

from kvstrata.config import ModelInfo, ServerArgs, explain, resolve
from kvstrata.config.kv_plan import mha_components
from kvstrata.config.kv_sizing import ModelKVFacts, size_kv_plan
from kvstrata.config.kv_sizing_state import TOO_SMALL_MESSAGE
from kvstrata.config.state_plan import StateComponent
from kvstrata.platform import simulated


def info_of(config) -> ModelInfo:
    return ModelInfo.from_hf_config(config if isinstance(config, dict) else config.to_dict())


@pytest.mark.parametrize("config, words", [
    (T.Qwen3NextConfig(num_hidden_layers=4), "layer_types: 3 of 4 layers recurrent"),
    (T.Qwen3_5TextConfig(num_hidden_layers=8), "layer_types: 6 of 8 layers recurrent"),
    (T.Qwen3_5Config(text_config={"num_hidden_layers": 4}), "text_config layer_types: 3 of 4"),
    (T.NemotronHConfig(hybrid_override_pattern="M-M*", num_hidden_layers=4),
     "layers_block_type: 2 of 4"),
    ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M-M*-M"},
     "hybrid_override_pattern: 4 of 8 layers Mamba2"),
    (T.GraniteMoeHybridConfig(layer_types=["mamba", "attention", "mamba"],
                              num_hidden_layers=3), "layer_types: 2 of 3"),
    ({"model_type": "granitemoehybrid", "layer_types": ["mamba", "attention"]},
     "layer_types: 1 of 2"),
    (T.Mamba2Config(num_hidden_layers=2), "model_type mamba2: every layer"),
    (T.FalconH1Config(num_hidden_layers=2), "model_type falcon_h1: every layer"),
    (T.JambaConfig(num_hidden_layers=8), "model_type jamba: 7 of 8 layers Mamba"),
])
def test_recurrent_models_are_recognised_from_their_configs(config, words):
    info = info_of(config)
    assert info.has_recurrent_state and words in info.recurrent_layers, info
    assert info.layer_windows is None


@pytest.mark.parametrize("config", [
    T.LlamaConfig(num_hidden_layers=2), T.Qwen3Config(num_hidden_layers=2),
    # a Granite hybrid config whose layers are all attention keeps no state (it still has
    # mamba_d_state: the old guess by field name said it did)
    T.GraniteMoeHybridConfig(layer_types=["attention"] * 3, num_hidden_layers=3),
    {"model_type": "nemotron_h", "hybrid_override_pattern": "*-*-"},
    # "linear" in a model type is no recurrent layer
    {"model_type": "my_linear_model", "num_hidden_layers": 2},
])
def test_models_without_recurrent_layers_keep_no_state(config):
    assert not info_of(config).has_recurrent_state


QWEN3_NEXT = info_of(T.Qwen3NextConfig(num_hidden_layers=4))


def run(info=QWEN3_NEXT, **kw):
    resolved, res = resolve(ServerArgs(**kw), simulated("cpu"), info, env={})
    return resolved, {r.field: r for r in res}


@pytest.mark.parametrize("kw, strategy, per_request", [
    ({}, "no_buffer", 3),
    ({"page_size": 16}, "extra_buffer", 4),
    ({"mamba_radix_cache_strategy": "extra_buffer"}, "extra_buffer", 4),
    ({"page_size": 16, "disable_radix_cache": True}, "auto", 1),
])
def test_strategy_and_slots_per_request(kw, strategy, per_request):
    resolved, res = run(**kw)
    assert resolved.mamba_radix_cache_strategy == strategy
    assert resolved.state_slots_per_request == per_request
    why = res["state_slots_per_request"]
    assert why.rule == "state.slots_per_request" and "bound --max-running-requests" in why.reason
    assert "layer_types: 3 of 4" in why.reason
    resolved_here = strategy != "auto" and "mamba_radix_cache_strategy" not in kw
    assert ("mamba_radix_cache_strategy" in res) == resolved_here


def test_extra_buffer_tracks_every_page_end_unless_told():
    resolved, res = run(page_size=16)
    assert resolved.mamba_track_interval == 16 and res["mamba_track_interval"].rule == \
        "state.track_interval" and "SGLang's 256" in res["mamba_track_interval"].reason
    assert run(page_size=16, mamba_track_interval=256)[0].mamba_track_interval == 256
    assert run()[0].mamba_track_interval is None  # no_buffer: no track points


@pytest.mark.parametrize("kw, match", [
    ({"page_size": 16, "mamba_radix_cache_strategy": "no_buffer"},
     "Page size must be 1 for MambaRadixCache v1"),
    ({"page_size": 16, "mamba_track_interval": 100}, "must be a multiple of --page-size 16"),
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "x"},
     "--speculative-algorithm EAGLE: a draft head over a recurrent target"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_max_bfs_breadth": 2},
     "NGRAM tree drafts"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_match_type": "PROB"},
     "NGRAM tree drafts"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "x",
      "speculative_eagle_topk": 4}, "--speculative-eagle-topk 4: a recurrent layer verifies"),
    ({"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True},
     "incompatible with Mamba/SSM models"),
    ({"hicache_mamba_size_gb": "1"}, "--hicache-mamba-size-gb without --enable-hierarchical"),
    ({"disaggregation_mode": "decode", "disaggregation_decode_enable_offload_kvcache": True,
      "hicache_storage_backend": "file"}, "a PD decode server's HiCache / KV offload"),
    ({"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "x"},
     "--speculative-algorithm EAGLE3: a draft head over a recurrent target"),
    ({"speculative_algorithm": "NEXTN"}, "NEXTN on this model: only Qwen3-Next's, "
                                         "Qwen3.5's and Qwen3.5-MoE's MTP layers are built"),
    ({"tp_size": 2, "speculative_algorithm": "NEXTN"},
     "--tp-size 2 with --speculative-algorithm NEXTN on this model: the MTP layer is split "
     "across ranks for Qwen3_5ForCausalLM and Qwen3NextForCausalLM only"),
    ({"quantization": "gptq"}, "--quantization gptq: the recurrent hybrids run w8a8_int8"),
    ({"tp_size": 2, "quantization": "w8a8_int8"}, "--tp-size 2 with --quantization w8a8_int8"),
    ({"enable_deterministic_inference": True},
     "--enable-deterministic-inference: not implemented yet for a recurrent model"),
])
def test_unbuilt_combinations_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        run(**kw)


def test_w8a8_int8_resolves_on_a_recurrent_model():
    """runner/quant/hybrid_w8a8.py: the hybrids' projections in int8 (the refusal above keeps
    the schemes not built, by name)."""
    resolved, _ = run(quantization="w8a8_int8")
    assert resolved.quantization == "w8a8_int8"


def test_tp_runs_the_built_hybrids_and_refuses_other_architectures():
    """runner/parallel/tp_hybrid.py: Qwen3-Next and Falcon-H1 (and Qwen3.5, Nemotron-H,
    Mamba2, Granite-4.0-H) resolve at --tp-size 2; a recurrent architecture without a
    tensor-parallel class is refused by name."""
    falcon = info_of({**T.FalconH1Config(num_hidden_layers=2).to_dict(),
                      "architectures": ["FalconH1ForCausalLM"]})
    for info in (QWEN3_NEXT, falcon):
        resolved, _ = run(info, tp_size=2)
        assert resolved.tp_size == 2
    other = dataclasses.replace(QWEN3_NEXT, architecture="KimiLinearForCausalLM")
    with pytest.raises(ValueError, match="--tp-size 2: tensor parallelism over "
                                         "KimiLinearForCausalLM's recurrent layers"):
        run(other, tp_size=2)


@pytest.mark.parametrize("config,arch", [(T.Qwen3NextConfig, "Qwen3NextForCausalLM"),
                                         (T.Qwen3_5TextConfig, "Qwen3_5ForCausalLM"),
                                         (T.Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM")])
def test_nextn_is_built_for_qwen3_next_and_qwen3_5_chains_only(config, arch):
    """Qwen3-Next's, Qwen3.5's and Qwen3.5-MoE's MTP layer drafts (runner/spec/mtp_hybrid.py):
    NEXTN resolves to EAGLE over its own checkpoint, co-located and under PD, and at
    --tp-size 2 on Qwen3-Next and Qwen3.5 (Qwen3.5-MoE has no tensor-parallel class: refused
    by name); trees and other recurrent architectures are refused."""
    info = info_of({**config(num_hidden_layers=4).to_dict(), "architectures": [arch]})
    assert info.architecture == arch
    resolved, _ = run(info, model_path="m", speculative_algorithm="NEXTN")
    assert (resolved.speculative_algorithm, resolved.speculative_draft_model_path,
            resolved.speculative_eagle_topk) == ("EAGLE", "m", 1)
    with pytest.raises(ValueError, match="--speculative-eagle-topk 2: a recurrent layer "
                                         "verifies chains only"):
        run(info, speculative_algorithm="NEXTN", speculative_eagle_topk=2)
    for mode in ("prefill", "decode"):
        resolved, _ = run(info, model_path="m", speculative_algorithm="NEXTN",
                          disaggregation_mode=mode)
        assert resolved.speculative_algorithm == "EAGLE"
    if arch == "Qwen3_5MoeForCausalLM":
        with pytest.raises(ValueError, match="--tp-size 2 with --speculative-algorithm NEXTN "
                                             "on Qwen3_5MoeForCausalLM: the MTP layer is"):
            run(info, model_path="m", speculative_algorithm="NEXTN", tp_size=2)
    else:
        resolved, _ = run(info, model_path="m", speculative_algorithm="NEXTN", tp_size=2)
        assert (resolved.tp_size, resolved.speculative_algorithm) == (2, "EAGLE")
    nemotron = info_of({**T.NemotronHConfig(num_hidden_layers=4,
                                            hybrid_override_pattern="M*M-").to_dict(),
                        "architectures": ["NemotronHForCausalLM"]})
    with pytest.raises(ValueError, match="NEXTN on NemotronHForCausalLM: only Qwen3-Next's"):
        run(nemotron, speculative_algorithm="NEXTN")


def test_pd_servers_resolve_and_the_decode_holds_one_slot_a_request():
    """PD runs (the final state crosses, cache/state_pd.py): the prefill keeps its snapshot
    cache; a decode server keeps no prefix cache, so each request holds one slot (the one its
    state is received into); retraction backs the slot up with cpu_tensor (the auto rule),
    an explicit host_pool is refused (SGLang: the host pool carries no recurrent state)."""
    prefill, _ = run(disaggregation_mode="prefill")
    assert prefill.state_slots_per_request == 3
    decode, res = run(disaggregation_mode="decode")
    assert decode.state_slots_per_request == 1
    assert "a PD decode server keeps no prefix cache" in res["state_slots_per_request"].reason
    assert decode.disaggregation_decode_retraction_backup == "cpu_tensor"
    assert "recurrent/SSM state" in res["disaggregation_decode_retraction_backup"].reason
    with pytest.raises(ValueError, match="does not support models with recurrent/SSM state"):
        run(disaggregation_mode="decode", disaggregation_decode_retraction_backup="host_pool")


@pytest.mark.parametrize("kw", [{"speculative_algorithm": "NGRAM"},
                                {"speculative_algorithm": "STANDALONE",
                                 "speculative_draft_model_path": "x"}])
def test_ngram_and_standalone_chains_resolve(kw):
    resolved, _ = run(page_size=16, **kw)
    assert resolved.speculative_eagle_topk == 1 and resolved.state_slots_per_request == 4


@pytest.mark.parametrize("backend", ["file", "mooncake", "memory"])
def test_hicache_storage_resolves(backend):
    """HiCache L3 stores state snapshots beside the pages (cache/state_storage.py)."""
    resolved, _ = run(enable_hierarchical_cache=True, hicache_ratio=2.0,
                      hicache_storage_backend=backend)
    assert resolved.hicache_storage_backend == backend


def test_models_without_state_ignore_the_flags():
    resolved, res = run(ModelInfo(), page_size=16, mamba_radix_cache_strategy="no_buffer")
    assert resolved.state_slots_per_request is None and "mamba_radix_cache_strategy" not in res


def test_explain_says_state_slots_bound_concurrency(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(T.Qwen3NextConfig(
        num_hidden_layers=4).to_dict()))
    text = explain(ServerArgs(model_path=str(tmp_path)), "cpu")
    assert "recurrent state True (layer_types: 3 of 4 layers recurrent)" in text
    assert "state.slots_per_request" in text and "// 3 bound --max-running-requests" in text


# ---- sizing ---------------------------------------------------------------------------------
CONV = StateComponent("conv", 3, (96, 3), "float32")      # 1152 B per layer
SSM = StateComponent("ssm", 3, (4, 16, 16), "float32")    # 4096 B per layer
PER_SLOT = 3 * (96 * 3 * 4 + 4 * 16 * 16 * 4)              # 15744
FACTS = ModelKVFacts("mha", mha_components(1, 2, 16, "float32"), 4096,
                     state_components=(CONV, SSM))        # 256 B of K/V per token
PURE = ModelKVFacts("none", (), 4096, state_components=(CONV, SSM))


def sized(facts=FACTS, budget=None, **kw):
    args, _ = run(**kw)
    plan, res = size_kv_plan(args, facts, budget)
    return plan, {r.field: r for r in res}


def test_budget_split_gives_the_states_r_over_1_plus_r():
    budget = 100 * 2**20
    plan, res = sized(budget=budget)
    share = int(budget * 0.9 / 1.9)
    assert plan.num_state_slots == share // PER_SLOT - 1
    assert plan.state_pool_bytes <= share < plan.state_pool_bytes + PER_SLOT
    assert plan.num_pages == (budget - plan.state_pool_bytes) // 256  # the rest to the K/V
    assert plan.num_rows == 256 and plan.num_rows * 3 <= plan.num_state_slots
    assert res["max_mamba_cache_size"].rule == "kv_plan.state_slots"
    assert "state slots bound concurrency" in res["max_running_requests"].reason


def test_state_slots_bound_running_requests():
    plan, res = sized(max_total_tokens=4096, max_mamba_cache_size=30)
    assert (plan.num_state_slots, plan.num_rows) == (30, 10)
    assert res["max_running_requests"].rule == "kv_plan.state_rows"
    assert "30 slots // 3 per running request = 10" in res["max_running_requests"].reason
    # an explicit --max-running-requests above the bound is cut, with a warning
    plan, res = sized(max_total_tokens=4096, max_mamba_cache_size=30, max_running_requests=64)
    assert plan.num_rows == 10 and res["max_running_requests"].warning


def test_explicit_tokens_get_r_times_their_bytes_of_state():
    plan, _ = sized(max_total_tokens=8192, page_size=16)
    assert plan.num_pages == 512
    assert plan.num_state_slots == int(8192 * 256 * 0.9) // PER_SLOT == 119
    assert plan.num_rows == 119 // 4  # extra_buffer at page size 16


def test_radix_cache_disabled_takes_one_slot_per_running_request():
    plan, _ = sized(max_total_tokens=4096, disable_radix_cache=True, max_running_requests=7)
    assert (plan.num_state_slots, plan.num_rows) == (7, 7)


def test_too_small_a_state_pool_is_refused_with_sglangs_message():
    with pytest.raises(ValueError, match=re.escape(TOO_SMALL_MESSAGE) + ": 2 state slots"):
        sized(max_total_tokens=4096, max_mamba_cache_size=2)
    with pytest.raises(ValueError, match=re.escape(TOO_SMALL_MESSAGE)):
        sized(budget=PER_SLOT * 3)


def test_ssm_dtype_overrides_the_models():
    plan, _ = sized(max_total_tokens=4096, max_mamba_cache_size=9, mamba_ssm_dtype="bfloat16")
    assert [c.dtype for c in plan.state_components] == ["float32", "bfloat16"]
    assert plan.state_bytes_per_slot == PER_SLOT - 3 * 4 * 16 * 16 * 2
    assert plan.to_json()["num_state_slots"] == 9


def test_a_model_without_attention_layers_keeps_addresses_only():
    plan, _ = sized(PURE, max_running_requests=4, context_length=100, page_size=4)
    assert plan.pool_kind == "none" and plan.components == ()
    # extra_buffer at page size 4: 4 slots per running request
    assert (plan.num_rows, plan.num_state_slots, plan.num_pages) == (4, 16, 4 * 25)


def test_a_model_without_attention_layers_sizes_only_the_slots_it_uses():
    """Mamba2 with a measured budget: no K/V to split it with, so the ratio does not apply;
    the pool is the running requests' slots (their working slots and snapshot share), not
    budget x r / (1 + r) of zeroed slots nothing reads -- fewer only when the budget holds
    fewer, and then those bound the running requests."""
    big = 1 << 30
    plan, res = sized(PURE, budget=big)
    assert (plan.num_rows, plan.num_state_slots) == (256, 3 * 256)  # no_buffer: 3 a request
    assert plan.state_pool_bytes == (3 * 256 + 1) * PER_SLOT < big // 50
    assert "3 per running request x 256 running requests" in res["max_mamba_cache_size"].reason
    plan, _ = sized(PURE, budget=big, max_running_requests=8, page_size=16)
    assert (plan.num_rows, plan.num_state_slots) == (8, 4 * 8)  # extra_buffer: 4 a request
    small = 31 * PER_SLOT  # 30 slots and the padding one
    plan, res = sized(PURE, budget=small)
    assert (plan.num_state_slots, plan.num_rows) == (30, 10)
    assert plan.state_pool_bytes <= small
    assert "the whole" in res["max_mamba_cache_size"].reason
    assert res["max_running_requests"].rule == "kv_plan.state_rows"
    with pytest.raises(ValueError, match=re.escape(TOO_SMALL_MESSAGE)):
        sized(PURE, budget=3 * PER_SLOT)
    # an explicit size still wins
    plan, _ = sized(PURE, budget=big, max_mamba_cache_size=2000)
    assert plan.num_state_slots == 2000


def test_a_standalone_draft_is_sized_beside_the_state():
    """A draft's K/V takes a slot per target slot (its bytes join each token's); the state
    ratio weighs the states against the target's K/V only. Mamba2 has no K/V slots for a
    draft to mirror: refused."""
    import dataclasses

    draft = mha_components(2, 1, 8, "float32")             # 128 B per token
    facts = dataclasses.replace(FACTS, draft_components=draft)
    budget = 100 * 2**20
    plan, _ = sized(facts, budget=budget, speculative_algorithm="NGRAM")
    alone, _ = sized(budget=budget)
    assert plan.draft_components == draft and plan.num_state_slots == alone.num_state_slots
    assert plan.num_pages == (budget - plan.state_pool_bytes) // (256 + 128)
    with pytest.raises(ValueError, match="without attention K/V"):
        sized(dataclasses.replace(PURE, draft_components=draft), max_running_requests=4)
