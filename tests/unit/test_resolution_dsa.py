"""Step 6: DSA gates (remap PD seed to decode-local slots; fused top-k) truth table."""
from __future__ import annotations

import itertools

import pytest

from kvstrata.config import ModelInfo, ServerArgs, resolve
from kvstrata.config.rules.dsa import remap_pd_seed_to_local_slots, use_fused_topk
from kvstrata.platform import simulated

PLATFORMS = ["cuda", "hip", "npu", "xpu", "mps", "cpu"]
MODES = ["null", "prefill", "decode"]


def expected_remap(platform, fuse, mode, hisparse, dcp):
    return platform in ("cuda", "hip") and fuse and mode == "decode" and not hisparse and not dcp


@pytest.mark.parametrize("platform,fuse,mode,hisparse,dcp", list(itertools.product(
    PLATFORMS, [True, False], MODES, [False, True], [False, True])))
def test_gate_truth_table(platform, fuse, mode, hisparse, dcp):
    args = ServerArgs(disaggregation_mode=mode, enable_hisparse=hisparse,
                      dcp_size=2 if dcp else 1)
    resolved, res = resolve(args, simulated(platform), ModelInfo(uses_dsa=True),
                            env={"KVSTRATA_DSA_FUSE_TOPK": fuse})
    remap = expected_remap(platform, fuse, mode, hisparse, dcp)
    assert resolved.dsa_remap_pd_seed_to_local_slots is remap
    # the fused gate is reported for a seed that comes from draft-extend
    assert resolved.dsa_fused_topk is (fuse and (mode == "null" or remap))
    rules = {r.field: r.rule for r in res}
    assert rules["dsa_remap_pd_seed_to_local_slots"] == "dsa.remap_pd_seed"
    assert rules["dsa_fused_topk"] == "dsa.fused_topk"


@pytest.mark.parametrize("fuse,mode,from_draft_extend,remap,expected", [
    (True, "null", True, False, True),       # no PD: the seed is local
    (True, "prefill", False, False, True),   # target prefill: fused
    (True, "prefill", True, False, False),   # PD draft-extend seed without remap: unfused
    (True, "decode", True, True, True),      # remapped: fused
    (True, "decode", True, False, False),
    (True, "decode", False, False, True),
    (False, "null", False, False, False),    # env switch off: never fused
    (False, "decode", True, True, False),
])
def test_use_fused_topk(fuse, mode, from_draft_extend, remap, expected):
    assert use_fused_topk(fuse, mode, from_draft_extend, remap) is expected


def test_remap_pure_function():
    assert remap_pd_seed_to_local_slots("hip", True, "decode", False, False)
    assert not remap_pd_seed_to_local_slots("npu", True, "decode", False, False)


def test_env_default_is_fuse_on(monkeypatch):
    monkeypatch.delenv("KVSTRATA_DSA_FUSE_TOPK", raising=False)
    resolved, _ = resolve(ServerArgs(disaggregation_mode="decode"), simulated("cuda"),
                          ModelInfo(uses_dsa=True))
    assert resolved.dsa_remap_pd_seed_to_local_slots is True
    monkeypatch.setenv("KVSTRATA_DSA_FUSE_TOPK", "0")
    resolved, _ = resolve(ServerArgs(disaggregation_mode="decode"), simulated("cuda"),
                          ModelInfo(uses_dsa=True))
    assert resolved.dsa_remap_pd_seed_to_local_slots is False
    assert resolved.dsa_fused_topk is False


def test_gates_applied_but_not_listed_for_non_dsa_model():
    resolved, res = resolve(ServerArgs(), simulated("cuda"), ModelInfo(uses_dsa=False), env={})
    assert resolved.dsa_fused_topk is True
    assert not [r for r in res if r.field.startswith("dsa_")]
    # nor for an unknown model at serve time, unless asked (explain asks)
    _, res = resolve(ServerArgs(), simulated("cuda"), None, env={})
    assert not [r for r in res if r.field.startswith("dsa_")]
    _, res = resolve(ServerArgs(), simulated("cuda"), None, env={}, record_dsa_gates=True)
    assert {"dsa_remap_pd_seed_to_local_slots", "dsa_fused_topk"} <= {r.field for r in res}
