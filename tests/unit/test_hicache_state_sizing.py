"""HiCache L2 sizing of a recurrent model (config/kv_sizing_host_state.py): host pages
beside host state slots, from --hicache-mamba-size-gb (a size, or auto: SGLang's checkpoint
demand), --hicache-size or --hicache-ratio; a model without attention layers (Mamba2), whose
host pages are addresses only; and the resolution note that config --explain shows for
auto (rules/recurrent.py, state.host_split). The facts and helpers are
test_resolution_recurrent.py's."""
from __future__ import annotations

import json

import pytest
import transformers as T

from kvstrata.config import ServerArgs, explain
from kvstrata.config.kv_sizing_host_state import checkpoint_demand
from tests.unit.test_resolution_recurrent import FACTS, PER_SLOT, PURE, run, sized

HICACHE = dict(max_total_tokens=4096, max_mamba_cache_size=30, enable_hierarchical_cache=True)
ROWS = 10  # 30 slots // 3 per running request (no_buffer)


def test_hicache_gets_host_state_slots_at_the_ratio_of_the_device_ones():
    plan, res = sized(max_total_tokens=4096, max_mamba_cache_size=30,
                      enable_hierarchical_cache=True)
    assert plan.num_host_pages == 2 * 4096 and plan.num_host_state_slots == 60
    assert "--hicache-ratio 2.0 x 30 device state slots" in res["hicache_mamba_size_gb"].reason
    assert plan.host_pool_bytes == 8193 * 256 + 61 * PER_SLOT


def test_hicache_mamba_size_gb_fixes_the_state_share_of_hicache_size():
    plan, res = sized(max_total_tokens=4096, max_mamba_cache_size=30,
                      enable_hierarchical_cache=True, hicache_mamba_size_gb="0.001")
    assert plan.num_host_state_slots == 10**6 // PER_SLOT and "hicache_mamba_size_gb" not in res
    assert plan.num_host_pages == 2 * 4096  # pages still at the ratio
    plan, _ = sized(max_total_tokens=4096, max_mamba_cache_size=30,
                    enable_hierarchical_cache=True, hicache_size=0.004,
                    hicache_mamba_size_gb="0.001")
    assert plan.num_host_state_slots == 10**6 // PER_SLOT
    assert plan.num_host_pages == int(0.003 * 10**9) // 256  # the rest of --hicache-size


def test_hicache_size_alone_is_split_by_device_bytes():
    plan, res = sized(max_total_tokens=4096, max_mamba_cache_size=30,
                      enable_hierarchical_cache=True, hicache_size=0.01)
    share = 31 * PER_SLOT / (31 * PER_SLOT + 4096 * 256)
    assert plan.num_host_state_slots == int(0.01 * share * 10**9) // PER_SLOT
    assert abs(plan.num_host_pages - int(0.01 * (1 - share) * 10**9) // 256) <= 1
    assert "the states' share of device bytes" in res["hicache_mamba_size_gb"].reason


# ---- --hicache-mamba-size-gb auto ------------------------------------------------------------
def test_auto_out_of_hicache_size_meets_the_checkpoint_demand_of_the_rest():
    """The fixed point: the K/V pages get what the states leave, and the states are exactly
    one per 64-token chunk of those pages plus 4 per running request."""
    plan, res = sized(chunked_prefill_size=64, hicache_size=0.01, hicache_mamba_size_gb="auto",
                      **HICACHE)
    assert plan.num_rows == ROWS
    slots = plan.num_host_state_slots
    assert slots == checkpoint_demand(plan.num_host_pages, 64, ROWS) == 332
    assert plan.num_host_pages * 256 + slots * PER_SLOT <= 0.01e9
    assert plan.num_host_pages * 256 + (slots + 1) * PER_SLOT > 0.01e9 - 256  # all of it used
    why = res["hicache_mamba_size_gb"]
    assert why.rule == "kv_plan.host_state_slots" and why.new == f"{slots * PER_SLOT / 1e9:.6g}"
    assert "one per --chunked-prefill-size 64 tokens of the host K/V tier" in why.reason


def test_auto_beside_the_ratio_reads_the_demand_off_the_host_pages():
    plan, res = sized(chunked_prefill_size=64, hicache_mamba_size_gb="auto", **HICACHE)
    assert plan.num_host_pages == 2 * 4096  # the ratio's, whatever the states take
    assert plan.num_host_state_slots == 8192 // 64 + 4 * ROWS
    assert "--hicache-ratio 2.0 x 4096 device tokens" in res["hicache_mamba_size_gb"].reason


@pytest.mark.parametrize("kw, match", [
    ({"chunked_prefill_size": -1}, "needs chunked prefill"),
    ({"chunked_prefill_size": 64, "hicache_size": 0.0001}, "cannot hold the 4 x 10 finish"),
])
def test_auto_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        sized(hicache_mamba_size_gb="auto", **HICACHE, **kw)


def test_explain_says_how_auto_will_be_solved(tmp_path):
    _, res = run(enable_hierarchical_cache=True, hicache_mamba_size_gb="auto",
                 chunked_prefill_size=128)
    note = res["hicache_mamba_size_gb"]
    assert note.rule == "state.host_split" and note.new == "auto"
    (tmp_path / "config.json").write_text(json.dumps(T.Qwen3NextConfig(
        num_hidden_layers=4).to_dict()))
    text = explain(ServerArgs(model_path=str(tmp_path), enable_hierarchical_cache=True,
                              hicache_mamba_size_gb="auto"), "cpu")
    assert "state.host_split" in text and "one checkpoint per --chunked-prefill-size" in text


# ---- a model without attention layers (Mamba2): host pages are addresses -----------------------
PURE_HICACHE = dict(max_running_requests=4, context_length=100, page_size=4,
                    max_mamba_cache_size=30, enable_hierarchical_cache=True)


@pytest.mark.parametrize("kw, host_slots, how", [
    ({}, 60, "--hicache-ratio 2.0 x 30 device state slots"),
    ({"hicache_size": 0.001}, 10**6 // PER_SLOT, "--hicache-size 0.001, all of it"),
    ({"hicache_size": 0.001, "hicache_mamba_size_gb": "0.0005"}, 5 * 10**5 // PER_SLOT, None),
    ({"hicache_mamba_size_gb": "auto"}, 60, "no host K/V tier to anchor"),
])
def test_a_model_without_kv_keeps_only_state_slots_on_the_host(kw, host_slots, how):
    plan, res = sized(PURE, **PURE_HICACHE, **kw)
    assert plan.pool_kind == "none" and not plan.pages_hold_kv
    assert plan.num_pages == 4 * 25 and plan.num_host_pages == 2 * 4 * 25  # ids, no bytes
    assert plan.num_host_state_slots == host_slots
    assert plan.host_pool_bytes == (host_slots + 1) * PER_SLOT
    if how is None:
        assert "hicache_mamba_size_gb" not in res
    else:
        assert how in res["hicache_mamba_size_gb"].reason


@pytest.mark.parametrize("facts, kw, match", [
    (FACTS, {"hicache_mamba_size_gb": "x"}, "must be a size in GB or 'auto'"),
    (FACTS, {"hicache_mamba_size_gb": "0.01", "hicache_size": 0.01}, "leaves no host memory"),
    (FACTS, {"hicache_mamba_size_gb": "0.00000001"}, "holds no state slot"),
    (PURE, {"hicache_mamba_size_gb": "0.01", "hicache_size": 0.001}, "exceeds --hicache-size"),
])
def test_hicache_sizing_refusals(facts, kw, match):
    with pytest.raises(ValueError, match=match):
        sized(facts, max_running_requests=4, **HICACHE, **kw)
