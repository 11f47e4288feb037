"""The VNNI int8 layer of --quantization w8a8_int8 (runner/cpu/int8_linear.py) against int8
arithmetic done by hand in torch: per-channel weight codes, per-token activation codes,
y = (codes_x @ codes_w.T) * w_scale * x_scale + bias, in the input's dtype.

The GEMM (oneDNN's, or kvstrata's on AVX512-VNNI or, without VNNI, on its AVX2 tile) is exact
in int32; what the layer adds is the C row passes, so the results must equal the hand
computation up to one float rounding of the scales' products, and the scalar, AVX2 and
AVX-512 paths must agree bit for bit."""
from __future__ import annotations

import os

import pytest
import torch

from kvstrata.runner.cpu import int8_linear
from kvstrata.runner.cpu.int8_linear import Int8MatmulLinear
from kvstrata.runner.quant.w8a8 import cpu_has_vnni, int8_kernel

from helpers.int8_layers import layer as _layer
from helpers.int8_layers import own_gemm

pytestmark = pytest.mark.skipif(
    not (int8_linear.available(cpu_has_vnni()) or int8_linear.avx2_gemm_available()),
    reason="the layer runs with VNNI or, without, on AVX2 + FMA + F16C (fbgemm elsewhere)")
# oneDNN's int8 linear is exact only with VNNI (its u8 x s8 pairs saturate on AVX2): shapes
# kvstrata's GEMM does not take, and the comparisons against oneDNN, need it -- real VNNI: on
# emulated AVX-512 (tests/helpers/emulated_isa.py) oneDNN still runs the CPU's AVX2 code.
ONEDNN = int8_linear.available(cpu_has_vnni())
ONEDNN_EXACT = ONEDNN and not os.environ.get("KVSTRATA_EMULATED_ISA_DIR")
onednn = pytest.mark.skipif(not ONEDNN_EXACT, reason="oneDNN's int8 linear needs VNNI")


def _needs_onednn(layer: Int8MatmulLinear) -> None:
    if not layer.own and not ONEDNN_EXACT:
        pytest.skip("a shape kvstrata's GEMM does not take: oneDNN's, which needs VNNI")


def by_hand(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x = x.float()
    w_scale = (weight.abs().amax(1) / 127).clamp(min=1e-12)
    amax = x.abs().amax(1).clamp(min=1e-12)
    x_scale = amax / 127
    wq = torch.round(weight / w_scale[:, None]).clamp(-127, 127)
    # As the C row computes it: 127 / amax divided (python's 127 / t is reciprocal(t) * 127,
    # a different float at exact .5 ties of bf16 inputs), then x times that, half to even.
    inv = torch.div(torch.full_like(amax, 127.0), amax)
    xq = torch.round(x * inv[:, None]).clamp(-127, 127)
    acc = (xq.double() @ wq.double().T)  # exact: integers well inside float64's mantissa
    y = (acc * w_scale.double()[None]).float() * x_scale[:, None]
    return y if bias is None else y + bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,bias", [(80, 96, True), (576, 960, False), (1536, 40, True),
                                      (17, 5, False)])
def test_equals_int8_arithmetic_by_hand(dtype, k, n, bias):
    torch.manual_seed(k + n)
    weight = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    x = torch.randn(7, k).to(dtype)
    layer = Int8MatmulLinear(weight, b)
    _needs_onednn(layer)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (7, n)
    want = by_hand(x, weight, b)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    else:  # the same float32 value, rounded once to bf16 (half an ulp; 1 where ties differ)
        ulp = 2.0 ** (torch.frexp(want).exponent.float() - 8)
        assert ((got.float() - want).abs() <= ulp + 1e-6).all()


def test_rows_are_independent_of_the_batch_and_of_the_isa(monkeypatch):
    torch.manual_seed(0)
    layer = Int8MatmulLinear(torch.randn(3072, 576), torch.randn(3072))
    x = torch.randn(33, 576).bfloat16()
    got = layer(x)
    loud = torch.cat([x, 100 * torch.randn(1, 576).bfloat16()])
    assert torch.equal(layer(loud)[:33], got)  # a louder token changes nobody's scale
    assert torch.equal(layer(x[:1]), got[:1])  # M = 1 takes oneDNN's other kernels
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "scalar")
    assert torch.equal(layer(x), got)  # the scalar rows compute what AVX-512's do


def test_shapes_views_and_extremes():
    torch.manual_seed(1)
    layer = Int8MatmulLinear(torch.randn(64, 1536))
    wide = torch.randn(5, 2000)
    view = wide[:, 100:1636]  # rows strided, elements contiguous: read in place
    torch.testing.assert_close(layer(view), layer(view.contiguous()), atol=0, rtol=0)
    assert layer(torch.randn(2, 3, 1536)).shape == (2, 3, 64)
    assert layer(torch.randn(0, 1536)).shape == (0, 64)
    assert torch.equal(layer(torch.zeros(2, 1536)), torch.zeros(2, 64))
    # Every code at +-127 over K = 1536: the int32 sums reach 127 * 127 * 1536 = 24.8M,
    # which VNNI accumulates without saturating (u8 * s8 pairs summed in int32).
    # (And the AVX2 tile: |s| * (w with s's sign) keeps each vpmaddubsw pair <= 2 * 127^2.)
    ext = Int8MatmulLinear(torch.full((16, 1536), -1.0))
    x = torch.ones(1, 1536)
    torch.testing.assert_close(ext(x), torch.full((1, 16), -1536.0), atol=0, rtol=1e-6)
    assert ext(x.double()).dtype == torch.float64  # other dtypes go through float32


def test_the_env_switches_back_to_fbgemm(monkeypatch):
    from kvstrata.runner.quant.w8a8 import W8A8Int8Linear, avx2_or_fbgemm

    assert int8_kernel()[0] is (Int8MatmulLinear if ONEDNN else avx2_or_fbgemm)
    if not ONEDNN:  # without VNNI a shape the AVX2 tile does not take stays fbgemm's
        assert type(avx2_or_fbgemm(torch.randn(16, 30))) is W8A8Int8Linear  # 30 % 4
        padded = avx2_or_fbgemm(torch.randn(20, 64))  # 20 % 16: zero rows pad it to 32
        assert type(padded) is Int8MatmulLinear and padded.pad == 12
        assert type(avx2_or_fbgemm(torch.randn(32, 64))) is Int8MatmulLinear
        monkeypatch.setenv("KVSTRATA_CPU_INT8_GEMM", "onednn")
        assert int8_kernel()[0] is W8A8Int8Linear
        monkeypatch.setenv("KVSTRATA_CPU_INT8_GEMM", "auto")
    monkeypatch.setenv("KVSTRATA_CPU_INT8_MM", "0")
    assert int8_kernel()[0] is W8A8Int8Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter,bias", [(1536, False), (40, True), (13, False)])
@pytest.mark.parametrize("isa", ["auto", "scalar"])
def test_fused_silu_mul_equals_the_two_steps(dtype, inter, bias, isa, monkeypatch):
    """linear_silu_mul = this layer, then cpu_ops.silu_mul: bit for bit, on every ISA path
    (widths that are and are not multiples of 16), with a gate|up bias or without."""
    from kvstrata.runner.cpu import fused_ops as cpu_ops
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    torch.manual_seed(inter)
    layer = Int8MatmulLinear(torch.randn(2 * inter, 96), torch.randn(2 * inter) if bias else None)
    _needs_onednn(layer)
    x = torch.randn(9, 96).to(dtype)
    want = cpu_ops.silu_mul(layer(x))
    got = layer.linear_silu_mul(x)
    assert want is not None and got.dtype == dtype and torch.equal(got, want)
    assert layer.linear_silu_mul(x[:0]).shape == (0, inter)
    assert layer.linear_silu_mul(x[:, None]) is None  # not 2-D rows: the caller's two steps
    monkeypatch.setenv("KVSTRATA_CPU_FUSED_OPS", "0")
    assert layer.linear_silu_mul(x) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,bias", [(40, True), (40, False), (48, True), (8, False), (13, True),
                                    (64, False)])
@pytest.mark.parametrize("isa", ["auto", "avx2", "scalar"])
def test_dequant_silu_mul_takes_the_silu_path_cpu_ops_takes(dtype, n, bias, isa, monkeypatch):
    """The fused dequantisation + silu (the epilogue around oneDNN's GEMM: AMX, AVX-VNNI-only
    CPUs) against dequant_rows then cpu_ops.silu_mul, on any CPU: a width of 8 but not 16
    lanes runs cpu_ops' 8-lane silu, and the fused pass must too (an AMX box found its scalar
    silu off by ulps at inter = 40)."""
    from kvstrata.runner.cpu import _int8_ops, fused_ops as cpu_ops
    from kvstrata.runner.cpu.isa import isa_cap

    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    torch.manual_seed(n)
    m, cap, code = 7, isa_cap(), cpu_ops.DTYPES[dtype]
    y, scales = torch.randn(m, 2 * n) * 50, torch.rand(m) + 0.01
    b = torch.randn(2 * n) if bias else None
    b_ptr = 0 if b is None else b.data_ptr()
    gate_up = torch.empty(m, 2 * n, dtype=dtype)
    _int8_ops.dequant_rows(y.data_ptr(), m, 2 * n, scales.data_ptr(), b_ptr,
                           gate_up.data_ptr(), code, 1, cap)
    want = cpu_ops.silu_mul(gate_up)
    got = torch.empty(m, n, dtype=dtype)
    _int8_ops.dequant_silu_mul(y.data_ptr(), m, n, scales.data_ptr(), b_ptr, got.data_ptr(),
                               code, 2, cap)
    assert want is not None and torch.equal(got, want)


@pytest.mark.skipif(not int8_linear._int8_ops.kernel_isa(1), reason="needs AVX2 + FMA + F16C")
def test_own_choice_takes_the_gemm_where_auto_steps_aside(monkeypatch):
    """KVSTRATA_CPU_INT8_GEMM=own: kvstrata's GEMM also where auto leaves the layer to
    oneDNN -- a CPU with a VNNI flag but no AVX512-VNNI (its AVX2 tile, run here) -- for the
    A/B on such boxes; onednn never takes it. An AMX-INT8 CPU takes it with auto too (its
    VNNI tile measured 1.3-1.5x oneDNN's AMX path served; the choice only, simulated)."""
    flags = int8_linear.read_cpu_flags()
    with monkeypatch.context() as m:
        m.setattr(int8_linear, "_has_vnni512", lambda: True)
        m.setattr(int8_linear, "read_cpu_flags", lambda: flags | {"avx512_vnni", "amx_int8"})
        for choice, fits in (("auto", True), ("own", True), ("onednn", False)):
            m.setenv("KVSTRATA_CPU_INT8_GEMM", choice)
            assert int8_linear.own_gemm_fits(576, 960) is fits, choice
    if int8_linear._has_vnni512():
        return  # the AVX2 branch below is another CPU's
    torch.manual_seed(5)
    weight, b, x = torch.randn(48, 64), torch.randn(48), torch.randn(5, 64)
    plain = _layer(weight, b, "auto", monkeypatch)  # no VNNI flag here: the AVX2 tile
    monkeypatch.setattr(int8_linear, "read_cpu_flags", lambda: flags | {"avx_vnni"})
    assert not int8_linear.own_gemm_fits(64, 48)  # auto: oneDNN's with a VNNI flag
    forced = _layer(weight, b, "own", monkeypatch)
    assert plain.own and forced.own and torch.equal(forced(x), plain(x))
    monkeypatch.setenv("KVSTRATA_CPU_INT8_GEMM", "onednn")
    assert not int8_linear.own_gemm_fits(64, 48)


GEMM_SHAPES = [(576, 960, True), (1536, 576, False), (8, 16, True), (100, 48, False),
               (576, 80, True)]


@own_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,bias", GEMM_SHAPES + [(36, 32, True)])
def test_own_gemm_vector_tiles_equal_the_scalar_tile(dtype, k, n, bias, monkeypatch):
    """The VNNI or AVX2 tile against the scalar one (and its row quantiser): the same int32
    sums and float steps, so equal values for any row count (1-3 rows unpadded on AVX2, tiles
    of 4, panels cut short; k = 36 quantised by the scalar rows), and silu(gate) * up within
    the vector silu's ulps of the scalar expf's."""
    torch.manual_seed(k * n)
    weight, b = torch.randn(n, k), torch.randn(n) if bias else None
    layer = _layer(weight, b, "auto", monkeypatch)
    assert layer.own
    for m in (1, 2, 3, 4, 5, 32, 33):
        x = torch.randn(m, k).to(dtype)
        monkeypatch.setenv("KVSTRATA_CPU_ISA", "auto")
        vec = layer(x), layer.linear_silu_mul(x)
        monkeypatch.setenv("KVSTRATA_CPU_ISA", "scalar")
        scalar = layer(x), layer.linear_silu_mul(x)
        assert torch.equal(vec[0], scalar[0]), m
        if n % 32 == 0:
            torch.testing.assert_close(vec[1], scalar[1], atol=1e-6, rtol=1e-5 if
                                       dtype == torch.float32 else 8e-3)


@own_gemm
@onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,bias", GEMM_SHAPES)
@pytest.mark.parametrize("isa", ["auto", "scalar"])
def test_own_gemm_equals_onednn_bit_for_bit(dtype, k, n, bias, isa, monkeypatch):
    """kvstrata's GEMM (int8_gemm.h) against oneDNN's path: the same int32 sums and the same
    float steps after them, so equal values for any row count (tiles of 4 rows padded, panels
    of 4 blocks cut short at n = 16, 48, 80), dtype and ISA path (the scalar tile)."""
    torch.manual_seed(k * n)
    weight, b = torch.randn(n, k), torch.randn(n) if bias else None
    ours, theirs = _layer(weight, b, "auto", monkeypatch), _layer(weight, b, "onednn", monkeypatch)
    assert ours.own and not theirs.own
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    for m in (1, 3, 4, 5, 32, 33):
        x = torch.randn(m, k).to(dtype)
        assert torch.equal(ours(x), theirs(x)), m
    assert torch.equal(ours(x[:, None]), theirs(x[:, None]))  # [m, 1, k] through reshape


@own_gemm
@onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter,bias", [(1536, True), (48, False), (16, True), (40, False)])
def test_own_gemm_fused_silu_mul_equals_onednn(dtype, inter, bias, monkeypatch):
    """The gate|up tiles pair gate block j with up block j (an odd number of gate blocks cuts
    the last panel short: inter 48, 16); inter 40 is not a whole number of pairs of blocks and
    takes the GEMM then silu_mul. Either way: oneDNN's values, bit for bit."""
    torch.manual_seed(inter)
    weight, b = torch.randn(2 * inter, 64), torch.randn(2 * inter) if bias else None
    ours, theirs = _layer(weight, b, "auto", monkeypatch), _layer(weight, b, "onednn", monkeypatch)
    for m in (1, 6, 32):
        x = torch.randn(m, 64).to(dtype)
        assert torch.equal(ours.linear_silu_mul(x), theirs.linear_silu_mul(x)), m


@own_gemm
def test_own_gemm_extremes_strides_and_bad_input(monkeypatch):
    # Every code at +-127 over k = 1536 with u8 codes 255: the sums and the zero-point term
    # (128 * colsum) stay inside int32 and cancel exactly.
    ext = _layer(torch.full((16, 1536), -1.0), None, "auto", monkeypatch)
    assert ext.own
    torch.testing.assert_close(ext(torch.ones(2, 1536)), torch.full((2, 16), -1536.0),
                               atol=0, rtol=1e-6)
    assert torch.equal(ext(-torch.ones(1, 1536)), torch.full((1, 16), 1536.0))
    layer = _layer(torch.randn(32, 256), torch.randn(32), "auto", monkeypatch)
    wide = torch.randn(6, 400)
    assert torch.equal(layer(wide[:, 7:263]), layer(wide[:, 7:263].contiguous()))
    assert layer(torch.zeros(0, 256)).shape == (0, 32)
    assert layer.linear_silu_mul(torch.zeros(0, 256)).shape == (0, 16)
    assert _layer(torch.randn(20, 64), None, "auto", monkeypatch).pad == 12  # 20 % 16: padded
    assert not _layer(torch.randn(16, 30), None, "auto", monkeypatch).own  # 30 % 4: oneDNN
    from kvstrata.runner.cpu import _int8_ops
    with pytest.raises(ValueError, match="bad shape"):  # the C entry checks what it is given
        _int8_ops.linear(0, 6, 1, 6, 0, 0, 16, 0, 0, 0, 0, 0, 1, 2)
    # An AMX-INT8 CPU takes kvstrata's too (faster than oneDNN's AMX tiles up to 128 rows
    # and served), KVSTRATA_CPU_INT8_GEMM=onednn keeps oneDNN's; without VNNI the AVX2 tile
    # runs, and a VNNI flag (AVX-VNNI) hands it to oneDNN's.
    flags = int8_linear.read_cpu_flags()
    if ONEDNN and _int8_ops.kernel_isa(2) == 2:
        monkeypatch.setattr(int8_linear, "read_cpu_flags", lambda: flags | {"amx_int8"})
        assert int8_linear.own_gemm_fits(576, 960)
        assert int8_linear.kernel_name() == int8_linear.OWN_KERNEL
        monkeypatch.setattr(int8_linear, "read_cpu_flags", lambda: flags)
        assert int8_linear.kernel_name() == int8_linear.OWN_KERNEL
    if not ONEDNN:
        assert int8_linear.kernel_name() == int8_linear.OWN_AVX2_KERNEL
        monkeypatch.setattr(int8_linear, "read_cpu_flags", lambda: flags | {"avx_vnni"})
        assert not int8_linear.own_gemm_fits(576, 960)
        monkeypatch.setattr(int8_linear, "read_cpu_flags", lambda: flags)
    monkeypatch.setenv("KVSTRATA_CPU_INT8_MM", "1")
    monkeypatch.setenv("KVSTRATA_CPU_INT8_GEMM", "onednn")
    assert not int8_linear.own_gemm_fits(576, 960)
    monkeypatch.setenv("KVSTRATA_CPU_INT8_GEMM", "mkl")
    with pytest.raises(ValueError, match="KVSTRATA_CPU_INT8_GEMM"):
        Int8MatmulLinear(torch.randn(16, 64))


@own_gemm
def test_own_decode_choice_splits_rows_between_the_two_gemms(monkeypatch):
    """KVSTRATA_CPU_INT8_GEMM=own_decode on a CPU with a VNNI flag (simulated here where it
    has none): kvstrata's GEMM up to OWN_DECODE_MAX_ROWS rows, oneDNN's int8 linear above, in
    every entry (forward, the decoder's quantized_linear, fused silu, the decode plan's call);
    each side equals a layer of that one kernel bit for bit. Without a VNNI flag, or with
    auto / own, one layout."""
    from kvstrata.runner.models import decode_plan
    from kvstrata.runner.quant.w8a8 import quantized_linear
    flags = int8_linear.read_cpu_flags()
    monkeypatch.setattr(int8_linear, "read_cpu_flags", lambda: flags | {"avx512_vnni"})
    torch.manual_seed(6)
    weight, b = torch.randn(64, 96), torch.randn(64)
    split = _layer(weight, b, "own_decode", monkeypatch)
    assert int8_linear.split_layouts()
    assert f"up to {int8_linear.OWN_DECODE_MAX_ROWS} rows" in int8_linear.kernel_name()
    own, onednn = _layer(weight, b, "own", monkeypatch), _layer(weight, b, "onednn", monkeypatch)
    assert split.own and split.packed is not None and own.packed is None and not onednn.own
    assert split.nbytes == own.nbytes + weight.numel()  # the int8 weight twice
    top = int8_linear.OWN_DECODE_MAX_ROWS
    for m in (0, 1, top, top + 1, 300):
        x = torch.randn(m, 96).bfloat16()
        want = own if m <= top else onednn
        assert torch.equal(split(x), want(x)), m
        assert torch.equal(quantized_linear(x, split), want(x)), m
        assert torch.equal(split.linear_silu_mul(x), want.linear_silu_mul(x)), m
        out = torch.empty(m, 64, dtype=torch.bfloat16)
        model = type("Model", (), {"linear": staticmethod(quantized_linear)})()
        fn, args = decode_plan._linear_call(model, split, None, x, out, 1, 2)
        fn(*args)
        assert torch.equal(out, want(x)), m
    monkeypatch.setattr(int8_linear, "read_cpu_flags", lambda: flags - {"avx512_vnni",
                                                                         "avx_vnni"})
    if not int8_linear._has_vnni512():  # no VNNI flag: its AVX2 tile, one layout
        assert _layer(weight, b, "own_decode", monkeypatch).packed is None
