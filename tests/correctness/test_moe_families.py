"""Qwen3-MoE, Qwen2-MoE, Mixtral and GLM-4.5 (runner/models/moe_decoder.py) against transformers on
tiny random checkpoints (helpers/moe_ckpt.py, float32): prefill logits within 1e-4, greedy
tokens equal (vLLM's near-tie rule) on pages of 1 and 16, batched and chunked with staggered
arrivals; one engine run with chunked prefill and a radix hit; NGRAM speculation equal to
plain decoding; what these models do not run is refused by name.
--enable-deterministic-inference: at bf16 and float32 (Qwen3-MoE, Mixtral; Qwen2-MoE's and
GLM-4.5's shared experts at float32) each request's tokens and logprobs alone equal, bit for
bit, its run among others (mixed lengths and arrivals, chunked prefill, a radix hit); at
float32 greedy tokens of all four families still equal transformers'.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers.family_checks import (MODES, assert_greedy_in_mode_matches,
                                   assert_prefill_logits_match, assert_prefix_hit_matches,
                                   assert_ngram_equals_plain, cached_runner,
                                   random_prompts)
from helpers.gemma_ckpt import hf_greedy
from helpers.moe_ckpt import ARCH_NAMES, MIXTRAL_WINDOW, MOES, VOCAB, hf_moe, moe_checkpoints
from helpers.runner import make_runner

PREFILL_ATOL = 1e-4
NEW_TOKENS = 12
PROMPT_LENS = (1, 9, 17, 40)  # the longest crosses Mixtral's window (16) twice


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return moe_checkpoints(str(tmp_path_factory.mktemp("moe")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(5, PROMPT_LENS, VOCAB)


@pytest.fixture(scope="module")
def references(paths, prompts) -> dict:
    return {a: hf_greedy(hf_moe(paths[a]), prompts, NEW_TOKENS) for a in MOES}


_runner = cached_runner


@pytest.mark.parametrize("arch", MOES)
def test_model_is_built_as_configured(arch, paths):
    from kvstrata.runner.models.moe import MoE

    model = _runner(paths[arch], 1).model
    assert type(model).__name__ == "MoeDecoderForCausalLM"
    sparse = [layer.moe is not None for layer in model.layers]
    assert sparse == ([True, True] if arch in ("qwen2_moe", "mixtral") else [False, True])
    assert model.layer_windows == ([MIXTRAL_WINDOW] * 2 if arch == "mixtral" else None)
    moe = model.layers[1].moe
    if arch == "glm4_moe":  # DeepSeek-V3's block: grouped sigmoid router, shared experts
        assert isinstance(moe, MoE) and moe.score_bias is not None
        assert (moe.d.n_group, moe.d.topk_group, moe.d.num_experts_per_tok) == (4, 2, 2)
        # q/k/v biases (never o_proj's: spec.qkv_bias) and per-head q/k norms
        assert model.spec.qkv_bias and model.spec.qk_norm
        assert model.layers[0].q_norm is not None and model.layers[0].o_bias is None
        assert model.rotary.dim == 8  # half of each 16-wide head
        return
    assert (moe.num_experts, moe.top_k) == (8, 2)
    assert (moe.shared is not None) == (arch == "qwen2_moe")
    assert moe.norm_topk_prob == (arch != "qwen2_moe")
    # The CPU GEMMs take the projections and the MoE block's router and experts
    # (test_moe_packed.py checks them)
    assert len(moe.gate_up) == len(moe.down) == 8


@pytest.mark.parametrize("arch", MOES)
def test_prefill_logits_match_transformers(arch, paths, prompts):
    assert_prefill_logits_match(_runner(paths[arch], 1), hf_moe(paths[arch]), prompts,
                                PREFILL_ATOL)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", MOES)
def test_greedy_matches_transformers(arch, mode, paths, prompts, references):
    assert_greedy_in_mode_matches(_runner(paths[arch], MODES[mode][0]), mode, prompts,
                                  references[arch], NEW_TOKENS, arch)


def test_prefix_hit_and_chunked_prefill_match_transformers(paths, prompts):
    """Through the engine (Qwen2-MoE: shared expert): chunks of 16 on pages of 16, then a
    request whose first 32 tokens come from the radix cache; tokens and the first logprob
    equal transformers'."""
    path = paths["qwen2_moe"]
    assert_prefix_hit_matches(path, hf_moe(path), prompts[-1], PREFILL_ATOL)


def test_ngram_speculation_equals_plain(paths):
    """NGRAM drafts verified through the MoE layers (Qwen3-MoE)."""
    assert_ngram_equals_plain(paths["qwen3_moe"])


# ---------------------------------------------------------------- what is refused, by name
def test_unsupported_features_are_refused_by_name(paths):
    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.parallel.tp_load import load_tp_shard

    path = paths["mixtral"]  # (--quantization w8a8_int8 runs: test_w8a8_moe.py)
    source = resolve_model_path(path)  # tp 2 runs (test_tensor_parallel.py); 3 cannot split
    with pytest.raises(ValueError, match="--tp-size 3 must divide num_local_experts 8"):
        load_tp_shard(source, load_hf_config(source), SimpleNamespace(size=3, rank=0))


def test_served_at_the_default_flags(paths):
    """At the CPU's default flags (on an AVX2 CPU --dtype auto is bf16, where deterministic
    inference is on by default for dense models), a MoE checkpoint keeps the default off --
    its cost is not measured -- and serves; every MoE family resolves the same way."""
    from kvstrata import LLM
    from kvstrata.config import ModelInfo, ServerArgs, resolve
    from kvstrata.platform import detect_platform

    for arch in MOES:
        info = ModelInfo.from_model_path(paths[arch])
        assert info.routed_experts, arch
        resolved, _ = resolve(ServerArgs(model_path=paths[arch]), detect_platform(), info)
        assert resolved.enable_deterministic_inference is False, arch
    with LLM(model_path=paths["qwen3_moe"], skip_tokenizer_init=True,
             max_total_tokens=256) as llm:
        out = llm.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2,
                                                                 "temperature": 0})
    assert len(out["output_ids"]) == 2


def test_registry_names_the_moe_architectures():
    from kvstrata.runner.models.registry import arch_spec

    for arch in MOES:
        name = ARCH_NAMES[arch]
        assert arch_spec(SimpleNamespace(architectures=[name]))[1].family == "moe"


# ---------------------------------------------------------------- deterministic inference
DETERMINISTIC = ("qwen3_moe", "mixtral")


@pytest.mark.parametrize("arch,dtype", [(a, d) for a in DETERMINISTIC
                                        for d in ("bfloat16", "float32")]
                         # the shared experts (Qwen2-MoE's gated one, GLM-4.5's) and GLM's
                         # float32 grouped router (moe.MoE)
                         + [("qwen2_moe", "float32"), ("glm4_moe", "float32")])
def test_deterministic_bits_do_not_depend_on_the_batch(arch, dtype, paths):
    """With the flag: the router, every expert and the combine on batch-invariant kernels
    (runner/cpu/fixed_experts.py). Each request's tokens and logprobs (greedy and seeded)
    alone on a cold engine equal its run beside others of mixed lengths arriving at other
    steps (so the experts see other token counts), prompts chunked in 7s, the shared prefix a
    radix hit of the last cold run. float32 too: on an AVX2 CPU without AVX-512 torch's bf16
    F.linear happens to be batch-invariant (no oneDNN bf16 kernels), its fp32 one is not --
    with the experts on F.linear the fp32 case fails here."""
    from kvstrata import LLM
    from kvstrata.runner.cpu.packed_linear import PackedLinear
    from tests.correctness.test_deterministic_inference import (drive, params,
                                                                prompts_with_prefix)

    llm = LLM(model_path=paths[arch], skip_tokenizer_init=True, dtype=dtype,
              enable_deterministic_inference=True, chunked_prefill_size=7,
              max_total_tokens=2048)
    try:
        moe = llm.engine.runner.model.layers[1].moe
        assert all(isinstance(w, PackedLinear) and w.fixed
                   for w in (moe.router, moe.gate_up[0], moe.down[7]))
        prompts = prompts_with_prefix(11, 20, [3, 14, 27, 40])
        work = [(i, p, params(8, None if i % 2 else 5 + i)) for i, p in enumerate(prompts)]
        cold = []
        for _, prompt, sp in work:
            llm.flush_cache()
            cold.append(drive(llm, [(0, prompt, sp)])[0])
        # the last cold run's prompt stays cached: the batch's shared prefix hits it
        assert llm.get_load()["num_cached_tokens"] >= 20
        warm = drive(llm, work)
        assert warm == cold
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", MOES)
def test_deterministic_fp32_greedy_matches_transformers(arch, paths, prompts, references):
    """float32 with the flag (the fixed fp32 GEMM for every linear, experts included):
    greedy tokens still equal transformers', pages of 16, chunks of 6, staggered."""
    runner = make_runner(paths[arch], page_size=16, max_total_tokens=2048, context_length=128,
                         max_running_requests=8, dtype="float32",
                         enable_deterministic_inference=True)
    assert runner.model.layers[1].moe.batch_invariant
    assert_greedy_in_mode_matches(runner, "p16_chunk6_staggered", prompts, references[arch],
                                  NEW_TOKENS, arch)
