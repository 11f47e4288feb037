"""kvstrata's int8 GEMM on AMX-INT8 tiles (runner/cpu/csrc/int8_gemm_amx.h): the items on tiles
emulated in memory on any CPU, the opt-in choice (KVSTRATA_CPU_INT8_GEMM=amx), and on an
AMX-INT8 CPU the tiles themselves against the VNNI tile, bit for bit."""
from __future__ import annotations

import pytest
import torch

from helpers.int8_layers import int8_isa_now as _int8_ops_isa_now
from helpers.int8_layers import layer as _layer
from helpers.int8_layers import own_gemm
from kvstrata.runner.cpu import int8_linear
@own_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,bias", [(576, 960, True), (1536, 576, False), (64, 80, True),
                                      (128, 64, False)])
def test_amx_int8_tiles_emulated_equal_the_scalar_tile(dtype, k, n, bias, monkeypatch):
    """int8_gemm_amx.h's items on tiles emulated in memory (the addressing its AMX-INT8 run
    uses): rows padded to 16 with code 128, one and two A tiles, panels of two blocks and a
    last one-block panel (n = 80); the scalar epilogue per 4 rows, and where the VNNI tile
    runs (or is emulated: test_emulated_avx512.py) the tiles' own, row_out_vnni. tdpbusd's
    int32 sums are vpdpbusd's, so every row, silu(gate) * up included, equals that tile's."""
    from kvstrata.runner.cpu import _int8_ops
    torch.manual_seed(k + n)
    weight, b = torch.randn(n, k), torch.randn(n) if bias else None
    layer = _layer(weight, b, "auto", monkeypatch)
    assert layer.own and not layer.amx
    for isa in ("scalar", "auto") if _int8_ops.kernel_isa(2) == 2 else ("scalar",):
        monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
        for m in (1, 5, 15, 16, 17, 31, 32, 33, 50):
            x = torch.randn(m, k + 8).to(dtype)[:, 4:4 + k]
            for silu in (False, True) if n % 32 == 0 else (False,):
                want = layer.own_rows(x, m, x.stride(0), silu)  # that tile (cap)
                got = torch.empty_like(want)
                fn, args = layer.own_call(x, m, x.stride(0), got, silu)
                assert fn is _int8_ops.linear
                _int8_ops.linear_amx_emulated(*args)
                assert torch.equal(got, want), (isa, m, silu)
    with pytest.raises(ValueError, match="k % 64"):
        odd = _layer(torch.randn(16, 36), None, "auto", monkeypatch)
        x = torch.randn(2, 36)
        _int8_ops.linear_amx_emulated(*odd.own_call(x, 2, 36, torch.empty(2, 16), False)[1])


@own_gemm
def test_amx_choice_passes_the_tiles_cap(monkeypatch):
    """KVSTRATA_CPU_INT8_GEMM=amx: the layer's calls carry ISA cap 3 (the tiles where the CPU
    has AMX-INT8, the VNNI or AVX2 tile elsewhere); any other choice caps them at 2. Its
    values are the tiles' or the VNNI tile's: equal either way."""
    torch.manual_seed(5)
    weight = torch.randn(64, 128)
    x = torch.randn(9, 128)
    auto = _layer(weight, None, "auto", monkeypatch)
    amx = _layer(weight, None, "amx", monkeypatch)
    assert amx.amx and not auto.amx
    out = torch.empty(9, 64)
    assert auto.own_call(x, 9, 128, out, False, cap=3)[1][-1] == 2
    assert amx.own_call(x, 9, 128, out, False, cap=3)[1][-1] == 3
    assert amx.own_call(x, 9, 128, out, False, cap=1)[1][-1] == 1
    assert torch.equal(amx(x), auto(x))
    want = (f"{int8_linear.OWN_AMX_KERNEL} above 4 rows" if _int8_ops_isa_now(3) == 3
            else int8_linear.OWN_KERNEL if _int8_ops_isa_now(2) == 2
            else int8_linear.OWN_AVX2_KERNEL)
    assert int8_linear.kernel_name().startswith(want)


@pytest.mark.skipif(_int8_ops_isa_now(3) != 3, reason="needs AMX-INT8 (and Linux's leave)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_int8_tiles_equal_the_vnni_tile(dtype, monkeypatch):
    """On an AMX-INT8 CPU: KVSTRATA_CPU_INT8_GEMM=amx's layer (the tiles above 4 rows, k %
    64 == 0) equals auto's (the VNNI tile) bit for bit at every row count, silu included."""
    torch.manual_seed(7)
    for k, n in ((576, 960), (1536, 576), (128, 80), (100, 48)):
        weight, b = torch.randn(n, k), torch.randn(n)
        auto = _layer(weight, b, "auto", monkeypatch)
        amx = _layer(weight, b, "amx", monkeypatch)
        for m in (1, 4, 5, 16, 17, 32, 33, 64, 200):
            x = torch.randn(m, k).to(dtype)
            assert torch.equal(amx(x), auto(x)), (k, n, m)
            if n % 32 == 0:
                assert torch.equal(amx.linear_silu_mul(x), auto.linear_silu_mul(x)), (k, n, m)

