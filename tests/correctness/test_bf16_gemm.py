"""kvstrata's bf16 GEMM (runner/cpu/csrc/bf16_gemm.c, through runner/cpu/packed_linear.py) against
float64 arithmetic on the same bf16 values and against oneDNN's prepacked bf16 linear (F.linear
on a CPU where oneDNN has no bf16 kernels). Its AVX512-BF16 body runs where the CPU has it, the
AVX2 + FMA body (bf16_gemm_avx2.h) on AVX2-only CPUs; the AVX2 body is also tested on an
AVX-512 CPU by capping the ISA (test_avx2_body_*).

Every output is an fp32 sum of exact bf16 products rounded once to bf16, so it must sit within
one bf16 step (2^-7 relative) of the float64 result, plus the fp32 accumulation error; the
fused gate|up epilogue must equal the projection followed by cpu_ops.silu_mul bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.runner.cpu import _bf16_ops, fused_ops as cpu_ops, packed_linear
from kvstrata.runner.cpu.packed_linear import PackedLinear

# AVX512-BF16 (oneDNN has bf16 kernels there too; on emulated AVX-512, test_emulated_avx512.py,
# it has not: "onednn" layers keep F.linear, which these tests accept as well)
BF16_512 = _bf16_ops.has_bf16_512(2)
AVX2_OWN = _bf16_ops.kernel_isa(2) == 1 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
own_gemm = pytest.mark.skipif(not (BF16_512 or AVX2_OWN), reason="kvstrata's bf16 GEMM takes "
                              "bf16 layers with AVX512-BF16, or with AVX2 where oneDNN has none")


def _layer(weight, bias, gemm, monkeypatch) -> PackedLinear:
    monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", gemm)  # read when the weight is packed
    # an AMX box: measure ours anyway (no oneDNN layout for prefill rows beside it)
    monkeypatch.setattr(packed_linear, "amx_bf16_ready", lambda: False)
    return PackedLinear(weight, bias)


def assert_near_exact(out, x, weight, bias):
    """|out - exact| <= one bf16 step of |exact| + fp32 accumulation over k terms."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ weight.double().abs().T
    bound = exact.abs() * 2.0 ** -7 + scale * x.shape[-1] * 2.0 ** -23 + 1e-30
    assert out.dtype == torch.bfloat16
    assert bool(((out.double() - exact).abs() <= bound).all()), (out.double() - exact).abs().max()


@own_gemm
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


@own_gemm
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


@own_gemm
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


@own_gemm
def test_choice_rules_and_fallbacks(monkeypatch):
    torch.manual_seed(2)
    weight, b = torch.randn(32, 64).bfloat16(), torch.randn(32).bfloat16()
    assert not _layer(torch.randn(20, 64).bfloat16(), None, "auto", monkeypatch).own  # 20 % 16
    assert not _layer(torch.randn(16, 31).bfloat16(), None, "auto", monkeypatch).own  # 31 % 2
    assert not _layer(weight.float(), None, "auto", monkeypatch).own  # fp32: oneDNN's
    if BF16_512:
        monkeypatch.setattr(packed_linear, "amx_bf16_ready", lambda: True)
        # AMX: ours for decode rows, oneDNN's tiles above OWN_DECODE_MAX_ROWS
        assert packed_linear.own_bf16_fits(weight) and packed_linear.split_layouts()
        monkeypatch.setattr(packed_linear, "amx_bf16_ready", lambda: False)
    assert not packed_linear.split_layouts()  # without AMX: ours for every row count
    layer = _layer(weight, b, "auto", monkeypatch)
    assert packed_linear.kernel_name(layer) == {
        3: packed_linear.OWN_BF16_AMX_KERNEL, 2: packed_linear.OWN_BF16_KERNEL}.get(
            _bf16_ops.kernel_isa(3), packed_linear.OWN_BF16_AVX2_KERNEL)
    assert torch.equal(packed_linear.unpack_bf16(layer.packed), weight)
    x = torch.randn(5, 64).bfloat16()
    # KVSTRATA_CPU_ISA pinned to AVX2 after packing: the AVX2 body; to scalar: F.linear on
    # the unpacked weight.
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "avx2")
    assert_near_exact(layer(x), x.float(), weight.float(), b.float())
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "scalar")
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


@pytest.mark.skipif(_bf16_ops.kernel_isa(2) == 0, reason="needs AVX512-BF16 or AVX2 + FMA")
def test_own_choice_takes_the_gemm_where_auto_steps_aside(monkeypatch):
    """KVSTRATA_CPU_BF16_GEMM=own: kvstrata's GEMM also where auto leaves bf16 layers to
    oneDNN (an AVX2 CPU whose oneDNN has bf16 kernels), for the A/B there; its values are
    its body's, one rounding from exact. onednn never takes it. With AVX512-BF16 auto takes
    it on AMX too (for decode rows: split_layouts)."""
    monkeypatch.setattr(packed_linear, "amx_bf16_ready", lambda: True)
    monkeypatch.setattr(packed_linear, "_onednn_bf16", lambda: True)
    torch.manual_seed(3)
    weight, b = (torch.randn(48, 64) / 8).bfloat16(), torch.randn(48).bfloat16()
    want = {"auto": _bf16_ops.has_bf16_512(2), "own": True, "onednn": False}
    for choice, fits in want.items():
        monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", choice)
        assert packed_linear.own_bf16_fits(weight) is fits, choice
    monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", "own")
    layer = PackedLinear(weight, b)
    assert layer.own
    x = torch.randn(5, 64).bfloat16()
    assert_near_exact(layer(x), x.float(), weight.float(), b.float())
    assert not packed_linear.own_bf16_fits(weight.float())  # bf16 weights only


avx2_body = pytest.mark.skipif(_bf16_ops.kernel_isa(1) != 1, reason="needs AVX2 + FMA")


def _raw(x, packed, n, bias=None, silu=0, f32=0, cap=1, fn=_bf16_ops.linear):
    """_bf16_ops.linear on x's rows with the ISA capped (1: the AVX2 body on any AVX2 CPU);
    fn=_bf16_ops.linear_amx_emulated: the AMX body's items on emulated tiles."""
    m, k = x.shape
    out = torch.empty(m, n // 2 if silu else n, dtype=torch.float32 if f32 else torch.bfloat16)
    fn(x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), n,
       0 if bias is None else bias.data_ptr(), out.data_ptr(), silu, f32,
       torch.get_num_threads(), cap)
    return out


AMX_ROWS = (1, 5, 15, 16, 17, 31, 32, 33, 48, 50)  # the padded copy alone, x in place, both
# The emulated tiles' epilogue: the AVX2 one (cap 1), and the tiles' own AVX-512 one (cap 2)
# where the CPU has AVX512-BF16 or the tests emulate it (test_emulated_avx512.py).
AMX_EPILOGUES = [1, pytest.param(2, marks=pytest.mark.skipif(
    not _bf16_ops.has_bf16_512(2), reason="the AVX-512 epilogue needs AVX512-BF16"))]


@avx2_body
@pytest.mark.parametrize("cap", AMX_EPILOGUES)
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (64, 80), (32, 16)])
def test_amx_body_emulated_is_one_rounding_from_exact(k, n, cap):
    """bf16_gemm_amx.h's items on tiles emulated in memory (the addressing its AMX run uses):
    one and two A tiles, the last 1-15 rows from the zero-padded copy, panels of two blocks
    and a last one-block panel (n = 80, 16), rows `stride` apart, fp32 out; k % 32 only."""
    torch.manual_seed(k + n)
    weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
    bias = torch.randn(n)
    packed = packed_linear.pack_bf16(weight)
    emu = _bf16_ops.linear_amx_emulated
    for m in AMX_ROWS:
        x = torch.randn(m, k + 10).bfloat16()[:, 3:3 + k]
        out = _raw(x, packed, n, bias, cap=cap, fn=emu)
        assert_near_exact(out, x.float(), weight.float(), bias.double().float())
        assert torch.equal(_raw(x, packed, n, bias, f32=1, cap=cap, fn=emu), out.float())
    assert _raw(torch.zeros(0, k, dtype=torch.bfloat16), packed, n, fn=emu).shape == (0, n)
    with pytest.raises(ValueError, match="k % 32"):
        _raw(torch.zeros(1, 34, dtype=torch.bfloat16), packed_linear.pack_bf16(
            torch.zeros(16, 34).bfloat16()), 16, fn=emu)


@avx2_body
@pytest.mark.parametrize("cap", AMX_EPILOGUES)
@pytest.mark.parametrize("inter", [16, 48, 1536])
def test_amx_body_emulated_silu_equals_the_two_steps(inter, cap, monkeypatch):
    """Gate block p with its up block as one panel; the epilogue's silu is cpu_ops.silu_mul's
    (its rows at the same width), so the fused rows equal the two steps bit for bit."""
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "avx2" if cap == 1 else "avx512")
    torch.manual_seed(inter)
    weight = (torch.randn(2 * inter, 64) / 8).bfloat16()
    bias = torch.randn(2 * inter).bfloat16().float()
    packed = packed_linear.pack_bf16(weight)
    emu = _bf16_ops.linear_amx_emulated
    for m in (1, 17, 33):
        x = torch.randn(m, 64).bfloat16()
        assert torch.equal(_raw(x, packed, 2 * inter, bias, silu=1, cap=cap, fn=emu),
                           cpu_ops.silu_mul(_raw(x, packed, 2 * inter, bias, cap=cap, fn=emu)))


@pytest.mark.skipif(_bf16_ops.kernel_isa(3) != 3, reason="needs AMX-BF16 (and Linux's leave)")
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (64, 80), (96, 3072)])
def test_amx_body_on_the_tiles(k, n):
    """The AMX body itself: one rounding from exact, its fp32 out the same values, its silu
    rows equal to the two steps (both on AVX-512 there); k % 32 != 0 and calls of up to 4
    rows on the AVX512-BF16 tiles."""
    torch.manual_seed(k * n)
    weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
    bias = torch.randn(n)
    packed = packed_linear.pack_bf16(weight)
    for m in AMX_ROWS + (64, 200):
        x = torch.randn(m, k + 10).bfloat16()[:, 3:3 + k]
        out = _raw(x, packed, n, bias, cap=3)
        assert_near_exact(out, x.float(), weight.float(), bias.double().float())
        assert torch.equal(_raw(x, packed, n, bias, f32=1, cap=3), out.float())
        if n % 32 == 0:
            assert torch.equal(_raw(x, packed, n, bias, silu=1, cap=3),
                               cpu_ops.silu_mul(out))
    odd = (torch.randn(48, 34) / 6).bfloat16()
    x = torch.randn(20, 34).bfloat16()
    assert_near_exact(_raw(x, packed_linear.pack_bf16(odd), 48, cap=3), x.float(),
                      odd.float(), None)


@avx2_body
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (2, 16), (130, 48), (64, 96)])
def test_avx2_body_is_one_rounding_from_exact(k, n):
    """Tiles of up to 6 rows (row blocks as even as that allows: rows 1-7, 12, 13, 33 give
    every height) x one block, the panel's
    blocks one after the other; bias added before the one rounding; strided rows."""
    torch.manual_seed(k + n)
    weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
    bias = torch.randn(n)
    packed = packed_linear.pack_bf16(weight)
    for m in (1, 2, 3, 4, 5, 6, 7, 12, 13, 33):
        wide = torch.randn(m, k + 10).bfloat16()
        x = wide[:, 3:3 + k]
        assert_near_exact(_raw(x, packed, n, bias), x.float(), weight.float(),
                          bias.double().float())
        assert torch.equal(_raw(x, packed, n, bias, f32=1), _raw(x, packed, n, bias).float())
    assert _raw(torch.zeros(0, k, dtype=torch.bfloat16), packed, n).shape == (0, n)


@avx2_body
@pytest.mark.parametrize("inter", [16, 48, 1536])
def test_avx2_body_silu_equals_cpu_ops_two_steps(inter, monkeypatch):
    """The fused gate|up epilogue and cpu_ops.silu_mul's AVX2 rows share silu_v8: equal bit for
    bit (both capped to AVX2, as a model's calls are on an AVX2-only CPU)."""
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "avx2")
    torch.manual_seed(inter)
    weight = (torch.randn(2 * inter, 64) / 8).bfloat16()
    bias = torch.randn(2 * inter).bfloat16().float()
    packed = packed_linear.pack_bf16(weight)
    for m in (1, 6, 7, 32):
        x = torch.randn(m, 64).bfloat16()
        assert torch.equal(_raw(x, packed, 2 * inter, bias, silu=1),
                           cpu_ops.silu_mul(_raw(x, packed, 2 * inter, bias)))



@avx2_body
@pytest.mark.parametrize("k,n,silu", [(576, 960, 0), (1536, 576, 0), (64, 96, 1), (130, 64, 1)])
def test_avx2_body_widened_panels_equal_the_streamed_rows(k, n, silu):
    """From 5 row blocks of 6 rows on (bf16_gemm_avx2.h WIDEN_MIN_ROW_BLOCKS), each thread
    widens a panel's weights to fp32 once and its tiles read the floats: the same FMAs in the
    same order as a tile that widens them itself, so each row equals the same row computed in
    a call of 6 rows (one row block, streamed) bit for bit, bias and silu epilogue included."""
    torch.manual_seed(k * 3 + n)
    weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
    bias = torch.randn(n)
    packed = packed_linear.pack_bf16(weight)
    for m in (29, 30, 31, 100):
        x = torch.randn(m, k).bfloat16()
        full = _raw(x, packed, n, bias, silu=silu)
        parts = torch.cat([_raw(x[i:i + 6], packed, n, bias, silu=silu)
                           for i in range(0, m, 6)])
        assert torch.equal(full, parts)


@pytest.mark.skipif(_bf16_ops.kernel_isa(2) == 0, reason="needs AVX512-BF16 or AVX2 + FMA")
def test_own_decode_choice_splits_rows_between_the_two_gemms(monkeypatch):
    """KVSTRATA_CPU_BF16_GEMM=own_decode: kvstrata's GEMM up to OWN_DECODE_MAX_ROWS rows (its
    fused silu and fp32 head too), oneDNN's layout above (the caller's two steps), on a
    simulated AMX CPU. Where oneDNN has no bf16 kernels (AVX2) its two ops are stood in for
    by F.linear over the plain weight; on an AVX-512 CPU they are oneDNN's own."""
    monkeypatch.setattr(packed_linear, "amx_bf16_ready", lambda: True)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        monkeypatch.setattr(packed_linear, "_onednn_bf16", lambda: True)
        monkeypatch.setattr(packed_linear, "_onednn_pack", lambda w: w.detach().clone())
        monkeypatch.setattr(packed_linear, "_onednn_linear", F.linear)
    monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", "own_decode")
    torch.manual_seed(4)
    weight, b = (torch.randn(64, 96) / 10).bfloat16(), torch.randn(64).bfloat16()
    layer = PackedLinear(weight, b)
    assert layer.own and layer.onednn is not None
    assert layer.own_max_rows == packed_linear.OWN_DECODE_MAX_ROWS
    assert f"up to {packed_linear.OWN_DECODE_MAX_ROWS} rows" in packed_linear.kernel_name(layer)
    assert layer.nbytes == 2 * weight.numel() * 2 + b.numel() * (2 + 4)
    onednn = packed_linear._onednn_linear
    top = packed_linear.OWN_DECODE_MAX_ROWS
    for m in (1, 32, top, top + 1, 200):
        x = torch.randn(m, 96).bfloat16()
        own = m <= top
        out = layer(x)
        if own:
            assert torch.equal(out, layer.own_rows(x))
            assert_near_exact(out, x.float(), weight.float(), b.float())
            assert torch.equal(layer.linear_silu_mul(x), cpu_ops.silu_mul(out))
            assert torch.equal(layer.linear_float(x), out.float())
        else:
            assert torch.equal(out, onednn(x, layer.onednn, layer.bias))
            assert layer.linear_silu_mul(x) is None and layer.linear_float(x) is None
        assert layer.own_takes(x) is own
    monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", "own")
    assert PackedLinear(weight).onednn is None  # own: one layout
    monkeypatch.setenv("KVSTRATA_CPU_BF16_GEMM", "auto")  # AMX: both where AVX512-BF16 runs
    auto = PackedLinear(weight)
    assert auto.own == (auto.onednn is not None) == _bf16_ops.has_bf16_512(2)
