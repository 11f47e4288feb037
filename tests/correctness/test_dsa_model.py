"""Tiny random DeepSeek-V3.2 (MLA + DSA indexer + MoE) against transformers (float32).

index_topk (8) is below most prompt lengths, so attention is sparse from the 9th token on;
greedy tokens must equal transformers `generate` (near-tie rule) however the work is
batched: alone, batched, page sizes 1 and 16, chunked and staggered, either top-k domain,
through the engine with radix-cache hits and with forced retraction.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import DSA_INDEX_TOPK, GREEDY_TOKENS
from helpers.compare import assert_tokens_match
from helpers.driver import greedy_in_mode
from helpers.runner import forward_logits, make_runner, num_live_requests

PREFILL_ATOL = 1e-4
_runners: dict = {}


def _runner(path: str, page_size: int, fused: bool = True):
    key = (page_size, fused)
    if key not in _runners:
        runner = make_runner(path, page_size=page_size, max_total_tokens=4096,
                             context_length=512, max_running_requests=16)
        runner.model.attn_backend.fused_topk = fused
        _runners[key] = runner
    return _runners[key]


def test_prefill_logits_match_transformers(tiny_dsa_checkpoint, tiny_prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dsa_checkpoint, dtype=torch.float32).eval()
    runner = _runner(tiny_dsa_checkpoint, 1)
    assert runner.plan.pool_kind == "mla"
    assert [c.name for c in runner.plan.components] == ["kv_latent", "index_k"]
    for prompt in tiny_prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(forward_logits(runner, prompt), ref, atol=PREFILL_ATOL,
                                   rtol=0)


def test_sparsity_changes_the_output(tiny_dsa_checkpoint, tiny_prompts):
    """The top-k really bites: the dense MLA path (every earlier token) gives other logits
    on a prompt longer than index_topk, and the same on one shorter than it."""
    runner = _runner(tiny_dsa_checkpoint, 1)
    backend = runner.model.attn_backend
    long_prompt, short_prompt = tiny_prompts[-1], tiny_prompts[2]
    assert len(short_prompt) <= DSA_INDEX_TOPK < len(long_prompt)
    sparse_long, sparse_short = (forward_logits(runner, long_prompt),
                                 forward_logits(runner, short_prompt))
    backend.dense = True
    try:
        dense_long, dense_short = (forward_logits(runner, long_prompt),
                                   forward_logits(runner, short_prompt))
    finally:
        backend.dense = False
    assert (sparse_long - dense_long).abs().max() > 1e-2
    torch.testing.assert_close(sparse_short, dense_short, atol=1e-5, rtol=0)


# (page_size, batched?, prefill chunk, staggered arrivals?, fused top-k?)
MODES = {
    "p1_batched": (1, True, None, False, True),
    "p16_batched": (16, True, None, False, True),
    "p16_alone": (16, False, None, False, True),
    "p4_chunked_staggered": (4, True, 6, True, True),
    "p4_chunked_unfused": (4, True, 5, True, False),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers(mode, tiny_dsa_checkpoint, tiny_prompts,
                                     tiny_dsa_references):
    page_size, batched, chunk, staggered, fused = MODES[mode]
    runner = _runner(tiny_dsa_checkpoint, page_size, fused)
    outs = greedy_in_mode(runner, tiny_prompts, GREEDY_TOKENS, batched, chunk, staggered)
    for i, (ours, (ref_tokens, ref_logits)) in enumerate(zip(outs, tiny_dsa_references)):
        assert_tokens_match(ours, ref_tokens, ref_logits, label=f"dsa/{mode} prompt {i}")
    assert num_live_requests(runner) == 0


def _llm(path: str, **kw):
    from kvstrata import LLM

    return LLM(model_path=path, skip_tokenizer_init=True, dtype="float32", **kw)


def _generate(llm, prompts):
    params = {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}
    outs = llm.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
    llm.engine.check_integrity()
    return outs


def _check(outs, refs, label):
    for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outs, refs)):
        assert_tokens_match(out["output_ids"], ref_tokens, ref_logits, label=f"{label} {i}")


def test_engine_radix_hits(tiny_dsa_checkpoint, tiny_prompts, tiny_dsa_references):
    llm = _llm(tiny_dsa_checkpoint, page_size=4, chunked_prefill_size=16,
               max_total_tokens=2048)
    try:
        _check(_generate(llm, tiny_prompts), tiny_dsa_references, "first pass")
        again = _generate(llm, tiny_prompts)
        assert sum(o["meta_info"]["cached_tokens"] for o in again) > 100
        _check(again, tiny_dsa_references, "radix hit")
    finally:
        llm.shutdown()


def test_engine_forced_retraction(tiny_dsa_checkpoint, tiny_prompts, tiny_dsa_references):
    llm = _llm(tiny_dsa_checkpoint, page_size=4, chunked_prefill_size=16,
               max_total_tokens=192)
    try:
        outs = _generate(llm, tiny_prompts)
        assert llm.engine.scheduler.num_retractions > 0
        _check(outs, tiny_dsa_references, "retraction")
    finally:
        llm.shutdown()


def test_bf16_is_as_close_to_float32_as_transformers_bf16(tiny_dsa_checkpoint, tiny_prompts):
    """`--dtype bfloat16` (a DSA model keeps float32 under auto, but may be asked for bf16):
    the MoE's float32 routing weights met bf16 expert outputs (it raised a dtype error in
    index_copy_). Its prefill logits stay as close to transformers' float32 as transformers'
    own bf16 does (mean |error|; the tiny random model's bf16 logits move by up to their
    own scale at long prompts, in both), and the engine generates and drains cleanly."""
    from transformers import AutoModelForCausalLM

    ref32, ref16 = (AutoModelForCausalLM.from_pretrained(tiny_dsa_checkpoint, dtype=dtype).eval()
                    for dtype in (torch.float32, torch.bfloat16))
    runner = make_runner(tiny_dsa_checkpoint, page_size=1, max_total_tokens=1024,
                         context_length=512, max_running_requests=4, dtype="bfloat16")
    ours_err, hf_err = [], []
    for prompt in tiny_prompts:
        with torch.no_grad():
            want = ref32(torch.tensor([prompt])).logits[0]
            hf_err.append((ref16(torch.tensor([prompt])).logits[0].float() - want).abs().mean())
        ours_err.append((forward_logits(runner, prompt) - want).abs().mean())
    ours, hf = torch.stack(ours_err).mean().item(), torch.stack(hf_err).mean().item()
    assert ours <= 1.25 * hf + 0.01, (ours, hf)
    from kvstrata import LLM

    llm = LLM(model_path=tiny_dsa_checkpoint, skip_tokenizer_init=True, dtype="bfloat16",
              page_size=4, max_total_tokens=1024)
    try:
        outs = _generate(llm, tiny_prompts[:4])
        assert all(len(o["output_ids"]) == GREEDY_TOKENS for o in outs)
    finally:
        llm.shutdown()


def test_unknown_config_field_is_refused(tiny_dsa_checkpoint, tmp_path):
    dst = tmp_path / "dsa_unknown"
    shutil.copytree(tiny_dsa_checkpoint, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["index_fancy_rotation"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="index_fancy_rotation"):
        make_runner(str(dst), max_total_tokens=256)
    cfg.pop("index_fancy_rotation")
    cfg["scoring_func"] = "softmax"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="scoring_func"):
        make_runner(str(dst), max_total_tokens=256)


def test_fuse_topk_env_selects_the_unfused_domain(tiny_dsa_checkpoint, monkeypatch):
    """dsa_fused_topk is the resolved gate; KVSTRATA_DSA_FUSE_TOPK=0 turns it off."""
    assert make_runner(tiny_dsa_checkpoint, max_total_tokens=64).model.attn_backend.fused_topk
    monkeypatch.setenv("KVSTRATA_DSA_FUSE_TOPK", "0")
    runner = make_runner(tiny_dsa_checkpoint, max_total_tokens=64)
    assert runner.model.attn_backend.fused_topk is False
