"""Tiny random Gemma 3 (text) and Gemma 2 checkpoints against transformers (float32, eager
attention: the reference that soft-caps attention logits).

The checkpoints (tests/helpers/gemma_ckpt.py) have a window of 8, so prompts of 9 .. 70 tokens
and 24 decoded tokens cross it; Gemma 3's sixth layer is its one global layer. Prefill logits:
atol 1e-4 (observed ~5e-6). Greedy: 24 tokens per prompt equal up to vLLM's near-tie rule
under several ways of batching the same work (page sizes 1 and 16, chunks of 6 that cross the
window edge, staggered arrivals), and after a radix prefix hit.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers.compare import assert_tokens_match
from helpers.driver import greedy_in_mode
from helpers.gemma_ckpt import GEMMAS, VOCAB, WINDOW, gemma_checkpoints, hf_gemma, hf_greedy
from helpers.runner import forward_logits, make_runner, num_live_requests

PREFILL_ATOL = 1e-4
NEW_TOKENS = 24
# Shorter than the window, at it, just past it, and many windows long.
PROMPT_LENS = (1, 5, WINDOW - 1, WINDOW, WINDOW + 1, 20, 45, 70)
ARCH_NAMES = {"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}

_runners: dict = {}


@pytest.fixture(scope="module")
def gemma_paths(tmp_path_factory) -> dict[str, str]:
    return gemma_checkpoints(str(tmp_path_factory.mktemp("tiny_gemma")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(gemma_paths, prompts) -> dict:
    return {arch: hf_greedy(hf_gemma(path), prompts, NEW_TOKENS)
            for arch, path in gemma_paths.items()}


def _runner(path: str, page_size: int, deterministic: bool = False):
    key = (path, page_size, deterministic)
    if key not in _runners:
        _runners[key] = make_runner(path, page_size=page_size, max_total_tokens=4096,
                                    context_length=512, max_running_requests=16,
                                    enable_deterministic_inference=deterministic)
    return _runners[key]


@pytest.mark.parametrize("arch", GEMMAS)
def test_model_is_built_as_configured(arch, gemma_paths):
    model = _runner(gemma_paths[arch], 1).model
    if arch == "gemma3":  # five local layers, then the global one
        assert model.layer_windows == [WINDOW] * 5 + [None]
        assert model.attn_softcap is None and model.final_softcap is None
    else:
        assert model.layer_windows == [WINDOW, None, WINDOW, None]
        assert (model.attn_softcap, model.final_softcap) == (3.0, 15.0)
    assert model.attn_scale == 24 ** -0.5


def reference_attention(model):
    """Attention of one fresh sequence (no cache) as transformers' eager path computes it:
    scale, soft-cap, causal mask narrowed to the layer's window, float32 softmax."""
    def forward(i, q, k, v, fb, softcap=None):
        t, heads, dim = q.shape
        group = heads // k.shape[1]
        keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("thd,shd->hts", q, keys) * model.attn_scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(t)
        seen = pos[None, :] <= pos[:, None]
        if model.layer_windows[i] is not None:
            seen &= pos[None, :] > pos[:, None] - model.layer_windows[i]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        return torch.einsum("hts,shd->thd", probs, values).reshape(t, heads * dim)
    return forward


@pytest.mark.parametrize("arch", GEMMAS)
def test_layers_match_transformers_around_a_reference_attention(arch, gemma_paths, prompts,
                                                                monkeypatch):
    """The model's own arithmetic (norms, embedding scale, ropes per layer type, GeGLU,
    soft-caps, windows and scale as it declares them) with the attention kernel swapped for
    a plain reference: any prefill difference is the model's, not the backend's."""
    hf = hf_gemma(gemma_paths[arch])
    runner = _runner(gemma_paths[arch], 1)
    monkeypatch.setattr(runner.model, "attn_backend", SimpleNamespace(
        init_forward_metadata=lambda fb: None, forward=reference_attention(runner.model)))
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(forward_logits(runner, prompt), ref, atol=PREFILL_ATOL,
                                   rtol=0, msg=lambda m: f"{len(prompt)} tokens: {m}")


@pytest.mark.parametrize("arch", GEMMAS)
def test_prefill_logits_match_transformers(arch, gemma_paths, prompts):
    hf = hf_gemma(gemma_paths[arch])
    runner = _runner(gemma_paths[arch], 1)
    assert runner.max_context_len == 512  # the window is the kernel's, not a context cap
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(forward_logits(runner, prompt), ref, atol=PREFILL_ATOL,
                                   rtol=0, msg=lambda m: f"{len(prompt)} tokens: {m}")


# (page_size, batch everything together?, prefill chunk size, staggered arrivals?)
MODES = {
    "p1_batched": (1, True, None, False),
    "p16_batched": (16, True, None, False),
    "p16_alone": (16, False, None, False),
    "p1_chunked_6_staggered": (1, True, 6, True),   # chunk ends 6, 12, ... straddle 8
    "p16_chunked_6": (16, True, 6, False),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", GEMMAS)
def test_greedy_matches_transformers(arch, mode, gemma_paths, prompts, references):
    page_size, batched, chunk, staggered = MODES[mode]
    runner = _runner(gemma_paths[arch], page_size)
    outs = greedy_in_mode(runner, prompts, NEW_TOKENS, batched, chunk, staggered)
    for i, (ours, (ref_tokens, ref_logits)) in enumerate(zip(outs, references[arch])):
        assert_tokens_match(ours, ref_tokens, ref_logits,
                            label=f"{arch}/{mode} prompt of {len(prompts[i])}")
    assert num_live_requests(runner) == 0


@pytest.mark.parametrize("mode", ["p1_batched", "p16_chunked_6"])
@pytest.mark.parametrize("arch", GEMMAS)
def test_deterministic_kernels_match_transformers(arch, mode, gemma_paths, prompts, references):
    """Gemma 3 and Gemma 2 under --enable-deterministic-inference (fixed GEMMs, every query
    through the paged decode kernel, windows as its slot ranges, Gemma 2's soft-cap in the
    kernel's softmax): the same tokens."""
    page_size, batched, chunk, staggered = MODES[mode]
    runner = _runner(gemma_paths[arch], page_size, deterministic=True)
    assert runner.deterministic
    outs = greedy_in_mode(runner, prompts, NEW_TOKENS, batched, chunk, staggered)
    for i, (ours, (ref_tokens, ref_logits)) in enumerate(zip(outs, references[arch])):
        assert_tokens_match(ours, ref_tokens, ref_logits,
                            label=f"deterministic {arch}/{mode} prompt of {len(prompts[i])}")
    assert num_live_requests(runner) == 0


@pytest.mark.parametrize("arch", GEMMAS)
def test_prefix_hit_matches_transformers(arch, gemma_paths, prompts):
    """A radix hit: the second request reads 32 cached tokens (four windows) from the pool,
    prefills the rest in chunks of 16, and decodes; tokens and the first logprob equal
    transformers'."""
    from kvstrata import LLM

    prompt = prompts[-1]  # 70 tokens
    hf = hf_gemma(gemma_paths[arch])
    (ref_tokens, ref_logits), = hf_greedy(hf, [prompt], 8)
    with LLM(model_path=gemma_paths[arch], skip_tokenizer_init=True, page_size=16,
             chunked_prefill_size=16, max_total_tokens=4096) as llm:
        # logprobs: 0 gives each output token's logprob (return_logprob would ask for the
        # prompt's too, which recomputes the whole prompt instead of hitting the cache).
        greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        llm.generate(input_ids=prompt[:40], sampling_params=greedy)  # caches 32 tokens
        out = llm.generate(input_ids=prompt, sampling_params=greedy)
    assert out["meta_info"]["cached_tokens"] >= 32
    assert_tokens_match(out["output_ids"], ref_tokens, ref_logits, label=f"{arch} prefix hit")
    lp, token = out["meta_info"]["output_token_logprobs"][0][:2]
    assert abs(lp - torch.log_softmax(ref_logits[0], -1)[token].item()) < PREFILL_ATOL


@pytest.mark.parametrize("arch", GEMMAS)
def test_starved_pool_with_hicache_matches(arch, gemma_paths):
    """Multi-turn conversations (prompts of 49 .. 109 tokens) through a device pool of 160
    tokens: pages go to the host pool and come back on prefix hits, and the tokens equal a
    large pool's without HiCache, which equal transformers'. (Every layer keeps all its KV,
    so the host tier copies Gemma's pages as any model's.)"""
    from tests.correctness.test_hicache_engine import (assert_host_tier_served, make_llm,
                                                       multi_turn)

    big = make_llm(gemma_paths[arch], max_total_tokens=8192)
    try:
        prompts, expected = multi_turn(big)
    finally:
        big.shutdown()
    refs = hf_greedy(hf_gemma(gemma_paths[arch]), prompts, len(expected[0]))
    for ours, (ref_tokens, ref_logits) in zip(expected, refs):
        assert_tokens_match(ours, ref_tokens, ref_logits, label=f"{arch} multi-turn")
    llm = make_llm(gemma_paths[arch], max_total_tokens=160, enable_hierarchical_cache=True,
                   hicache_size=0, hicache_ratio=8.0)
    try:
        assert multi_turn(llm)[1] == expected
        assert_host_tier_served(llm)
    finally:
        llm.shutdown()


SPECULATION = {
    "ngram_p1_chunked": {"speculative_algorithm": "NGRAM", "page_size": 1,
                         "chunked_prefill_size": 8},
    "ngram_tree_p16": {"speculative_algorithm": "NGRAM", "page_size": 16,
                       "speculative_ngram_max_bfs_breadth": 4},
    "standalone_self_p16": {"speculative_algorithm": "STANDALONE", "page_size": 16,
                            "speculative_num_steps": 4},
}


@pytest.mark.parametrize("how", list(SPECULATION))
@pytest.mark.parametrize("arch", GEMMAS)
def test_speculative_decoding_equals_plain(arch, how, gemma_paths):
    """NGRAM (chains and trees) and STANDALONE (Gemma drafting for itself: its draft KV
    under the same windows) verify through the windowed attention: tokens and logprobs equal
    plain greedy decoding, then again from the radix cache."""
    from tests.correctness.test_speculative import (assert_same, drained, greedy, make_llm,
                                                    repeating_prompts)

    prompts, params, path = repeating_prompts(), greedy(40), gemma_paths[arch]
    plain = make_llm(path, False, max_total_tokens=8192)
    try:
        ref = plain.generate(input_ids=prompts, sampling_params=params)
    finally:
        plain.shutdown()
    kw = dict(SPECULATION[how])
    if kw["speculative_algorithm"] == "STANDALONE":
        kw["speculative_draft_model_path"] = path
    llm = make_llm(path, True, max_total_tokens=8192, **kw)
    try:
        assert_same(ref, llm.generate(input_ids=prompts, sampling_params=params))
        again = llm.generate(input_ids=prompts, sampling_params=params)
        assert_same(ref, again)
        assert sum(o["meta_info"]["spec_verify_ct"] for o in again) > 0
        drained(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", GEMMAS)
def test_bfloat16_runs_close_to_float32(arch, gemma_paths, prompts):
    """bf16 cannot match float32 token for token: its logits stay close to transformers'
    float32 ones (and to transformers' own bf16 run's distance), and it decodes."""
    path = gemma_paths[arch]
    runner = make_runner(path, dtype="bfloat16", page_size=16, max_total_tokens=1024,
                         context_length=512, max_running_requests=4)
    assert runner.kv_pool.kv.dtype == torch.bfloat16
    prompt = prompts[6]  # 45 tokens
    with torch.no_grad():
        ref = hf_gemma(path)(torch.tensor([prompt])).logits[0]
        hf_bf16 = hf_gemma(path, torch.bfloat16)(torch.tensor([prompt])).logits[0].float()
    ours = forward_logits(runner, prompt)
    err, hf_err = (ours - ref).abs().max(), (hf_bf16 - ref).abs().max()
    assert err < 0.15 * ref.abs().max()
    assert err < 2 * hf_err + 1e-3, (err, hf_err)
    outs = greedy_in_mode(runner, prompts[:3], 4, True)
    assert all(len(o) == 4 for o in outs)


# ---------------------------------------------------------------- what is refused, by name
def test_int8_quantization_is_refused(gemma_paths):
    with pytest.raises(ValueError, match="w8a8_int8 supports the llama-family decoder, its "
                                         "MoE members and DeepSeek only, not "
                                         "Gemma3ForCausalLM"):
        make_runner(gemma_paths["gemma3"], quantization="w8a8_int8", max_total_tokens=256)


def test_eagle_heads_are_refused(gemma_paths):
    """An EAGLE head reads hidden states the Gemma forward does not keep."""
    with pytest.raises(ValueError, match="EAGLE: EAGLE heads are not implemented for "
                                         "Gemma3ForCausalLM"):
        make_runner(gemma_paths["gemma3"], speculative_algorithm="EAGLE",
                    speculative_draft_model_path=gemma_paths["gemma3"], max_total_tokens=256)


def test_tensor_parallel_is_refused(gemma_paths):
    """Refused before any rank builds a shard (the group is not touched)."""
    from kvstrata.config.model_source import load_hf_config, resolve_model_path
    from kvstrata.runner.parallel.tp_load import load_tp_shard

    source = resolve_model_path(gemma_paths["gemma3"])
    with pytest.raises(ValueError, match="--tp-size 2: tensor parallelism is not implemented "
                                         "for Gemma3ForCausalLM"):
        load_tp_shard(source, load_hf_config(source), SimpleNamespace(size=2, rank=0))


def test_multimodal_gemma3_is_refused_by_name():
    from kvstrata.runner.models.registry import arch_spec

    config = SimpleNamespace(architectures=["Gemma3ForConditionalGeneration"])
    with pytest.raises(ValueError, match="'Gemma3ForConditionalGeneration'.*Gemma3ForCausalLM"):
        arch_spec(config)
