"""Hybrid SWA memory, the runner half: the windowed layers' K/V in a second pool (their slots
from ScheduledRequest.swa_slots), driven with hand-made SWA slots by tests/helpers/driver.py,
which frees each SWA page as soon as its request's next query can no longer reach it, so a
small SWA pool is reused while requests still run. Greedy tokens must equal transformers'
(eager attention) and the same runner with one uniform pool (--disable-hybrid-swa-memory).

Models: test_sliding_window_models.py's tiny Mistral (all 3 layers windowed, W = 8: an
all-SWA model, no full pool at all) and Qwen2 (layer 0 full, 1-2 windowed: both pools).
"""
from __future__ import annotations

import pytest

from helpers import driver
from helpers.runner import make_runner
from tests.correctness.test_sliding_window_models import (  # noqa: F401 (fixtures)
    NEW_TOKENS, WINDOW, check, prompts, references, windowed)


def runner_for(path, **kw):
    return make_runner(path, dtype="float32", **kw)


def test_pools_and_layer_mapping(windowed):
    """Mistral: every layer in the SWA pool, no full pool tensors; Qwen2: layer 0 in the main
    pool, layers 1 and 2 at SWA pool layers 0 and 1. --disable-hybrid-swa-memory: one pool."""
    r = runner_for(windowed["mistral"], max_total_tokens=64, max_running_requests=4)
    assert r.plan.pool_kind == "swa" and r.kv_pool is None
    assert r.swa_pool.kv.shape[1] == 3 and r.plan.max_swa_tokens == 64
    assert r.plan.num_pages == 4 * 512  # canonical ids: rows x context
    b = r.model.attn_backend
    assert [(pool is r.swa_pool, i) for pool, i in b.layer_kv] == [(True, 0), (True, 1),
                                                                     (True, 2)]
    r = runner_for(windowed["qwen2"], max_total_tokens=160, swa_full_tokens_ratio=0.5,
                   page_size=16)
    assert r.plan.max_total_tokens == 160 and r.plan.max_swa_tokens == 80
    assert r.kv_pool.kv.shape[1] == 1 and r.swa_pool.kv.shape[1] == 2
    b = r.model.attn_backend
    assert [(pool is r.swa_pool, i) for pool, i in b.layer_kv] == [(False, 0), (True, 0),
                                                                     (True, 1)]
    r = runner_for(windowed["qwen2"], max_total_tokens=160, disable_hybrid_swa_memory=True)
    assert r.plan.pool_kind == "mha" and r.swa_pool is None and r.kv_pool.kv.shape[1] == 3


def test_refuses_a_pool_smaller_than_one_window(windowed):
    with pytest.raises(ValueError, match="cannot hold even one request"):
        runner_for(windowed["mistral"], max_total_tokens=WINDOW + 1)
    with pytest.raises(ValueError, match="cannot hold even one request"):
        runner_for(windowed["qwen2"], max_total_tokens=160, page_size=16,
                   swa_full_tokens_ratio=0.1)


@pytest.mark.parametrize("arch,page_size,chunk,staggered", [
    ("mistral", 1, None, False), ("mistral", 16, None, False),
    ("mistral", 1, 6, True), ("mistral", 16, 16, True),   # chunks across the window edge
    ("qwen2", 1, 6, True), ("qwen2", 16, None, False), ("qwen2", 16, 16, True)])
def test_greedy_equals_transformers_and_uniform_pool(arch, page_size, chunk, staggered,
                                                     windowed, prompts, references):
    """Batched (and staggered: prefill chunks beside decodes), prompts up to ~9x the window.
    The SWA pool (256 tokens) is smaller than the requests' KV together (~320 tokens): the
    driver reuses pages freed out of the window while their requests still run."""
    stats = driver.SWA_STATS
    stats.update(allocated=0, freed_early=0)
    ratio = {} if arch == "mistral" else {"swa_full_tokens_ratio": 0.25}
    r = runner_for(windowed[arch], max_total_tokens=256 if arch == "mistral" else 1024,
                   page_size=page_size, **ratio)
    assert r.plan.max_swa_tokens == 256
    outs = driver.greedy_in_mode(r, prompts, NEW_TOKENS, True, chunk=chunk,
                                 staggered=staggered)
    label = f"{arch} P={page_size} chunk={chunk}"
    check(outs, references[arch], label + " hybrid")
    assert stats["freed_early"] > 0 and stats["allocated"] > r.plan.num_swa_pages, stats
    uniform = runner_for(windowed[arch], max_total_tokens=1024, page_size=page_size,
                         disable_hybrid_swa_memory=True)
    assert outs == driver.greedy_in_mode(uniform, prompts, NEW_TOKENS, True, chunk=chunk,
                                         staggered=staggered), label


def test_one_request_alone_and_decode_plan(windowed, prompts, references):
    """Each prompt alone (the all-SWA decode plan replays one plan over the SWA pool)."""
    from kvstrata.runner.models import decode_plan

    r = runner_for(windowed["mistral"], max_total_tokens=96)  # (a 70-token prompt at once)
    outs = driver.greedy_in_mode(r, prompts, NEW_TOKENS, False)
    check(outs, references["mistral"], "mistral alone")
    if decode_plan.enabled():
        plans = r.model.__dict__.get("_decode_plans", {})
        assert any(p is not None and p.swa_slots for p in plans.values())


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_deterministic_inference_over_both_pools(arch, windowed, prompts, references):
    """Every query through the paged decode kernel, key ranges from each layer's own table:
    transformers' tokens, chunked or not, batched or alone (bit-identical both ways)."""
    r = runner_for(windowed[arch], max_total_tokens=512, page_size=16,
                   enable_deterministic_inference=True)
    assert r.plan.pool_kind == "swa" and r.model.attn_backend.deterministic
    batched = driver.greedy_in_mode(r, prompts, NEW_TOKENS, True, chunk=16, staggered=True)
    check(batched, references[arch], f"{arch} deterministic")
    assert batched == driver.greedy_in_mode(r, prompts, NEW_TOKENS, False)
