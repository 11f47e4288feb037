"""packed_linear.split_layouts: a bf16 layer keeps oneDNN's layout for prefill rows beside
kvstrata's GEMM (auto) only where the AMX tiles run in this process -- the runtime answer of
kvstrata's own probe (amx_bf16_ready: bf16_gemm.c's body at the AMX cap, amx_tiles.h's
amx_ready), never the CPU's flags: a VM that lists amx_bf16 without granting the tile data
runs neither AMX body, and a split there doubled the weights for nothing. The probe is
monkeypatched both ways, so this runs on every CPU."""
from __future__ import annotations

import pytest
import torch

from kvstrata.runner.cpu import _bf16_ops, packed_linear

OWN_512 = _bf16_ops.has_bf16_512(2) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_the_probe_is_the_gemms_runtime_body_whatever_the_isa_cap(monkeypatch):
    want = _bf16_ops.kernel_isa(3) == 3
    assert packed_linear.amx_bf16_ready() == want
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "avx512")  # a cap on ours leaves oneDNN's tiles
    assert packed_linear.amx_bf16_ready() == want


@pytest.mark.parametrize("ready", [True, False])
def test_auto_splits_only_where_the_amx_tiles_run(ready, monkeypatch):
    from kvstrata import platform

    # the CPU names AMX either way: the flag no longer decides
    monkeypatch.setattr(platform, "read_cpu_flags", lambda *a: frozenset({"amx_bf16"}))
    monkeypatch.setattr(packed_linear, "amx_bf16_ready", lambda: ready)
    for choice, want in (("auto", ready), ("own_decode", True), ("own", False),
                         ("onednn", False)):
        monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", choice)
        assert packed_linear.split_layouts() == want, choice


@pytest.mark.skipif(not OWN_512, reason="kvstrata's AVX512-BF16 GEMM beside oneDNN's bf16")
@pytest.mark.parametrize("ready", [True, False])
def test_a_layer_keeps_the_second_layout_only_with_the_tiles(ready, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", "auto")
    monkeypatch.setattr(packed_linear, "amx_bf16_ready", lambda: ready)
    weight = torch.randn(32, 64).bfloat16()
    layer = packed_linear.PackedLinear(weight)
    assert layer.own and (layer.onednn is not None) == ready
    assert layer.own_max_rows == (packed_linear.OWN_DECODE_MAX_ROWS if ready else 1 << 62)
    # an MoE expert's layer: one layout whatever the tiles (fixed_experts.pack_block)
    assert packed_linear.PackedLinear(weight, split=False).onednn is None
