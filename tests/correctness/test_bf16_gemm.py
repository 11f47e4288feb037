"""kvstrata's bf16 GEMM (runner/csrc/bf16_gemm.c, through runner/packed_linear.py) against
float64 arithmetic on the same bf16 values and against oneDNN's prepacked bf16 linear.

Every output is an fp32 sum of exact bf16 products rounded once to bf16, so it must sit within
one bf16 step (2^-7 relative) of the float64 result, plus the fp32 accumulation error; the
fused gate|up epilogue must equal the projection followed by cpu_ops.silu_mul bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.runner import _bf16_ops, cpu_ops, packed_linear
from kvstrata.runner.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(
    not (_bf16_ops.has_bf16_512(2) and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="kvstrata's bf16 GEMM needs AVX512-BF16")


def _layer(weight, bias, gemm, monkeypatch) -> PackedLinear:
    monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", gemm)  # read when the weight is packed
    flags = packed_linear.read_cpu_flags() - {"amx_bf16"}  # an AMX box: measure ours anyway
    monkeypatch.setattr(packed_linear, "read_cpu_flags", lambda: flags)
    return PackedLinear(weight, bias)


def assert_near_exact(out, x, weight, bias):
    """|out - exact| <= one bf16 step of |exact| + fp32 accumulation over k terms."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ weight.double().abs().T
    bound = exact.abs() * 2.0 ** -7 + scale * x.shape[-1] * 2.0 ** -23 + 1e-30
    assert out.dtype == torch.bfloat16
    assert bool(((out.double() - exact).abs() <= bound).all()), (out.double() - exact).abs().max()


@pytest.mark.parametrize("k,n,bias", [(576, 960, True), (1536, 576, False), (2, 16, True),
                                      (130, 48, False), (64, 80, True), (576, 3072, False)])
def test_own_gemm_is_one_rounding_from_exact(k, n, bias, monkeypatch):
    """Tiles of up to 4 rows and panels of up to 4 blocks of 16 columns, the tails taken by
    narrower tiles (rows 1-3, 5, 33; n = 16, 48, 80 leave 1, 3 and 1 blocks)."""
    torch.manual_seed(k * n)
    weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    layer = _layer(weight, b, "auto", monkeypatch)
    assert layer.own and layer.packed.dtype == torch.bfloat16
    for m in (1, 2, 3, 4, 5, 32, 33):
        x = torch.randn(m, k).bfloat16()
        assert_near_exact(packed_linear.packed_linear(x, layer), x.float(), weight.float(),
                          None if b is None else b.float())
    assert layer(x[:, None]).shape == (33, 1, n)  # [m, 1, k] through reshape
    assert torch.equal(layer(x[:, None])[:, 0], layer(x))


def test_own_gemm_matches_onednn_and_views(monkeypatch):
    torch.manual_seed(1)
    weight, b = torch.randn(96, 256).bfloat16(), torch.randn(96).bfloat16()
    ours, theirs = _layer(weight, b, "auto", monkeypatch), _layer(weight, b, "onednn", monkeypatch)
    assert ours.own and not theirs.own
    wide = torch.randn(6, 400).bfloat16()
    x = wide[:, 7:263]  # rows 400 elements apart
    assert torch.equal(ours(x), ours(x.contiguous()))
    torch.testing.assert_close(ours(x), theirs(x.contiguous()), rtol=1.6e-2, atol=2e-2)
    # An output head's fp32 logits: the bf16 values widened, as F.linear(...).float().
    assert torch.equal(ours.linear_float(x), ours(x).float())
    assert ours.linear_float(x).dtype == torch.float32 and theirs.linear_float(x) is None
    # Other dtypes are converted (the model's calls are bf16); zero rows are fine.
    assert torch.equal(ours(x.float()), ours(x))
    assert ours(torch.zeros(0, 256, dtype=torch.bfloat16)).shape == (0, 96)
    assert theirs.nbytes == (96 * 256 + 96) * 2
    assert ours.nbytes == theirs.nbytes + 96 * 4  # and the bias in fp32 for the epilogue


@pytest.mark.parametrize("inter,bias", [(1536, True), (48, False), (16, True), (40, False)])
def test_fused_silu_mul_equals_the_two_steps(inter, bias, monkeypatch):
    """Gate block j pairs with up block j (odd gate-block counts cut the last panel short:
    inter 48, 16); inter 40 is not a whole number of block pairs: the caller's two steps."""
    torch.manual_seed(inter)
    weight = (torch.randn(2 * inter, 64) / 8).bfloat16()
    b = torch.randn(2 * inter).bfloat16() if bias else None
    layer = _layer(weight, b, "auto", monkeypatch)
    for m in (1, 6, 32):
        x = torch.randn(m, 64).bfloat16()
        fused = layer.linear_silu_mul(x)
        if inter % 16:
            assert fused is None
            continue
        assert torch.equal(fused, cpu_ops.silu_mul(layer(x))), m
    assert _layer(weight, b, "onednn", monkeypatch).linear_silu_mul(x) is None


def test_choice_rules_and_fallbacks(monkeypatch):
    torch.manual_seed(2)
    weight, b = torch.randn(32, 64).bfloat16(), torch.randn(32).bfloat16()
    assert not _layer(torch.randn(20, 64).bfloat16(), None, "auto", monkeypatch).own  # 20 % 16
    assert not _layer(torch.randn(16, 31).bfloat16(), None, "auto", monkeypatch).own  # 31 % 2
    assert not _layer(weight.float(), None, "auto", monkeypatch).own  # fp32: oneDNN's
    flags = packed_linear.read_cpu_flags()
    monkeypatch.setattr(packed_linear, "read_cpu_flags", lambda: flags | {"amx_bf16"})
    assert not packed_linear.own_bf16_fits(weight)  # AMX: oneDNN's tiles
    layer = _layer(weight, b, "auto", monkeypatch)
    assert packed_linear.kernel_name(layer) == packed_linear.OWN_BF16_KERNEL
    assert torch.equal(packed_linear.unpack_bf16(layer.packed), weight)
    # KVSTRATA_CPU_ISA pinned below AVX-512 after packing: F.linear on the unpacked weight.
    x = torch.randn(5, 64).bfloat16()
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "avx2")
    assert torch.equal(layer(x), F.linear(x, weight, b))
    assert torch.equal(layer.linear_silu_mul(x), cpu_ops.silu_mul(F.linear(x, weight, b)))
    assert torch.equal(layer.linear_float(x), F.linear(x, weight, b).float())
    monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", "mkl")
    with pytest.raises(ValueError, match="KVSTRATA_CPU_BF16_GEMM"):
        PackedLinear(weight)
    with pytest.raises(ValueError, match="bad shape"):  # the C entry checks what it is given
        _bf16_ops.linear(0, 6, 1, 6, 0, 24, 0, 0, 0, 0, 1, 2)
    with pytest.raises(ValueError, match="bad shape"):  # silu's output is bf16 only
        _bf16_ops.linear(0, 64, 1, 64, 0, 32, 0, 0, 1, 1, 1, 2)
