"""Sliding-window models end to end against transformers (float32, eager attention): a tiny
random Mistral whose every layer has a window of 8, and a Qwen2 with use_sliding_window
(layer 0 full, the others windowed: transformers' layer_types from max_window_layers).

Prompts shorter and much longer than the window; the engine batched at page sizes 1 and 16,
chunked prefill whose chunks cross the window edge, radix prefix hits, deterministic
inference, speculative verify (NGRAM trees, a STANDALONE self-draft's tree steps) and
tensor parallelism. The kernel-level cases are test_sliding_window_attention.py's.
"""
from __future__ import annotations

import random

import pytest
import torch

from helpers.compare import assert_tokens_match
from helpers.runner import forward_logits, make_runner

WINDOW = 8
VOCAB = 300
NEW_TOKENS = 24
LENGTHS = (1, 5, 8, 9, 20, 45, 70)


def _config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=88, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=WINDOW)
    return tf.Qwen2Config(**common, sliding_window=WINDOW, use_sliding_window=True,
                          max_window_layers=1)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> dict[str, str]:
    """arch -> a tiny checkpoint with sliding windows (built like conftest's tiny ones)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, arch in enumerate(("mistral", "qwen2")):
        torch.manual_seed(4321 + i)
        model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
        path = str(tmp_path_factory.mktemp(f"swa_{arch}"))
        model.save_pretrained(path, safe_serialization=True)
        out[arch] = path
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(17)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def references(windowed, prompts) -> dict:
    """arch -> (tokens, per-step logits) of transformers' greedy generate, eager attention."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for arch, path in windowed.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        refs[arch] = []
        for p in prompts:
            with torch.no_grad():
                out = hf.generate(torch.tensor([p]), do_sample=False,
                                  max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  output_logits=True, return_dict_in_generate=True,
                                  pad_token_id=0)
            refs[arch].append((out.sequences[0, len(p):].tolist(), [s[0] for s in out.logits]))
    return refs


def check(outs, refs, label):
    for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outs, refs)):
        ids = out["output_ids"] if isinstance(out, dict) else out
        assert_tokens_match(ids, ref_tokens, ref_logits, label=f"{label} prompt {i}")


GREEDY = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "temperature": 0}


def llm(path, **kw):
    """An engine over the one uniform pool (this file's subject: windows applied by attention
    alone); test_swa_memory_engine.py passes disable_hybrid_swa_memory=False for the SWA pool."""
    from kvstrata import LLM

    kw.setdefault("disable_hybrid_swa_memory", True)
    return LLM(model_path=path, skip_tokenizer_init=True, dtype="float32",
               max_total_tokens=kw.pop("max_total_tokens", 4096), **kw)


def test_the_windows_reach_the_backend(windowed):
    runner = make_runner(windowed["mistral"], max_total_tokens=1024)
    assert runner.model.attn_backend.layer_windows == (WINDOW,) * 3
    assert runner.max_context_len == 512  # no longer capped at the window
    runner = make_runner(windowed["qwen2"], max_total_tokens=1024)
    assert runner.model.attn_backend.layer_windows == (None, WINDOW, WINDOW)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_prefill_logits_match_transformers(arch, windowed, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(windowed[arch], dtype=torch.float32,
                                              attn_implementation="eager").eval()
    runner = make_runner(windowed[arch], max_total_tokens=1024)
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(forward_logits(runner, p), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,page_size,chunk,extra", [
    ("mistral", 1, None, {}), ("mistral", 16, None, {}),
    ("mistral", 1, 6, {}), ("mistral", 16, 16, {}),      # chunks across the window edge
    ("mistral", 16, 16, {"enable_deterministic_inference": True}),
    ("qwen2", 1, 6, {}), ("qwen2", 16, None, {})])
def test_engine_greedy_equals_transformers(arch, page_size, chunk, extra, windowed, prompts,
                                           references):
    """Batched, then again from the radix cache (prefix hits: chunks after a cached prefix
    longer than the window)."""
    engine = llm(windowed[arch], page_size=page_size, chunked_prefill_size=chunk or -1,
                 **extra)
    try:
        label = f"{arch} P={page_size} chunk={chunk} {extra}"
        check(engine.generate(input_ids=prompts, sampling_params=GREEDY), references[arch],
              label)
        again = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
        check(again, references[arch], label + " prefix-cached")
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_speculative_verify_and_draft_trees(windowed, prompts, references):
    """NGRAM trees (verify entries: decode-kernel queries and tree masks by position) and a
    STANDALONE self-draft with topk 3 (its tree steps' explicit key lists): transformers'
    tokens, and the drafts pass."""
    path = windowed["mistral"]
    refs = references["mistral"]
    teach = [p + r[0] for p, r in zip(prompts, refs)]
    for shape in ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8,
                   "speculative_ngram_max_bfs_breadth": 4},
                  {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": path,
                   "speculative_num_steps": 3, "speculative_eagle_topk": 3,
                   "speculative_num_draft_tokens": 8}):
        engine = llm(path, max_total_tokens=8192, speculative_disable_by_batch_size=1 << 20,
                     **shape)
        try:
            if shape["speculative_algorithm"] == "NGRAM":  # teach the n-gram cache
                engine.generate(input_ids=teach, sampling_params={"max_new_tokens": 1,
                                                                  "temperature": 0})
            outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            check(outs, refs, shape["speculative_algorithm"])
            assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0
        finally:
            engine.shutdown()


def test_tensor_parallel_ranks_apply_the_window(windowed, prompts, references):
    """Each rank's backend windows its own heads: tp 2 gives transformers' tokens."""
    with llm(windowed["mistral"], tp_size=2, page_size=16) as engine:
        check(engine.generate(input_ids=prompts, sampling_params=GREEDY),
              references["mistral"], "mistral tp 2")


def test_decode_plan_replays_one_window_for_all_layers(windowed, prompts, references):
    """The fused CPU decode plan (one plan replayed for every layer) runs for all-SWA
    Mistral, whose layers share one windowed plan, and never for Qwen2's mixed layers."""
    from helpers.driver import greedy_in_mode
    from kvstrata.runner.models import decode_plan

    if not decode_plan.enabled():
        pytest.skip("KVSTRATA_CPU_DECODE_PLAN=0")
    for arch, planned in (("mistral", True), ("qwen2", False)):
        runner = make_runner(windowed[arch], max_total_tokens=2048)
        outs = greedy_in_mode(runner, prompts, NEW_TOKENS, True)
        check(outs, references[arch], f"{arch} decode plan")
        plans = runner.model.__dict__.get("_decode_plans", {})
        assert any(p is not None for p in plans.values()) == planned, arch
