"""kvstrata's fp32 GEMV (runner/cpu/f32_gemv.py, csrc/f32_gemv.h) against torch's F.linear on the
same values: 0-8 rows (a panel pass takes 4), strided rows, with and without a bias, the scalar reference and the
AVX2 code; the layouts, the rule that decides whether a model keeps the copies, and the
dispatch inside packed_linear (1-16 rows take the GEMV on an AVX2-only CPU, 1-8 with AVX-512,
more rows kvstrata's fp32 GEMM over the same panels without AVX-512, oneDNN's layer with it or
with KVSTRATA_CPU_F32_GEMV=gemv)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.platform import read_cpu_flags
from kvstrata.runner.cpu import _bf16_ops, _cpu_ops, f32_gemv
from kvstrata.runner.cpu.packed_linear import PackedLinear, packed_linear

HAS_AVX2 = {"avx2", "fma", "f16c"} <= read_cpu_flags()


def _close(got, want):
    # fp32 sums of up to 1536 products in another order than MKL's
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cap", [0, 1, 2])
@pytest.mark.parametrize("n,k", [(16, 2), (48, 30), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 16])
def test_gemv_equals_f_linear(cap, n, k, m):
    g = torch.Generator().manual_seed(n * 7 + k + m)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    # rows of a wider tensor (a strided view, as a slice of a fused projection would be)
    wide = torch.randn(m, k + 6, generator=g)
    x = wide[:, 3:3 + k]
    panels = f32_gemv.pack(w)
    if m > f32_gemv.max_rows():  # an AVX-512 CPU: the layer takes oneDNN; the kernel still
        assert f32_gemv.linear(x, panels, b, cap=cap) is None
        got = torch.empty(m, n)
        _cpu_ops.gemv_f32(x.data_ptr(), x.stride(0), m, k, panels.data_ptr(), n, b.data_ptr(),
                          got.data_ptr(), torch.get_num_threads(), cap)
        _close(got, F.linear(x, w, b))
        return
    for bias in (b, None):
        got = f32_gemv.linear(x, panels, bias, cap=cap)
        assert got.shape == (m, n) and got.dtype == torch.float32
        _close(got, F.linear(x, w, bias))
    # leading dims are kept: [1, m, k] -> [1, m, n]
    _close(f32_gemv.linear(x[None], panels, b, cap=cap), F.linear(x, w, b)[None])


def test_gemv_threads_and_layout():
    """Any thread count gives the same values (panels split across threads); pack and
    unpack are inverses; zero rows is an empty result."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3072, 576, generator=g)
    panels = f32_gemv.pack(w)
    assert panels.shape == (192, 576, 16) and torch.equal(f32_gemv.unpack(panels), w)
    assert torch.equal(panels[1, 5], w[16:32, 5])
    x = torch.randn(2, 576, generator=g)
    outs = []
    for threads in (1, 2, 3):
        out = torch.empty(2, 3072)
        _cpu_ops.gemv_f32(x.data_ptr(), 576, 2, 576, panels.data_ptr(), 3072, 0, out.data_ptr(),
                          threads, 2)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert f32_gemv.linear(torch.empty(0, 576), panels, None, cap=2).shape == (0, 3072)


def test_gemv_refuses_what_it_does_not_take():
    w = torch.randn(32, 8)
    panels = f32_gemv.pack(w)
    assert f32_gemv.linear(torch.randn(17, 8), panels, None) is None  # more rows: oneDNN
    assert f32_gemv.linear(torch.randn(1, 8).bfloat16(), panels, None) is None
    assert f32_gemv.linear(torch.randn(1, 8), panels, torch.randn(32).bfloat16()) is None
    assert not f32_gemv.fits(torch.randn(30, 8))  # out % 16
    assert not f32_gemv.fits(torch.randn(32, 7))  # in odd
    assert not f32_gemv.fits(w.bfloat16())
    out = torch.empty(17, 32)
    with pytest.raises(ValueError, match="bad shape"):
        _cpu_ops.gemv_f32(0, 8, 17, 8, panels.data_ptr(), 32, 0, out.data_ptr(), 1, 2)
    with pytest.raises(ValueError, match="bad shape"):
        _cpu_ops.gemv_f32(0, 7, 1, 7, panels.data_ptr(), 32, 0, out.data_ptr(), 1, 2)


def test_copies_are_kept_by_the_rule(monkeypatch):
    """auto: every weight fits, the CPU has AVX2 + FMA, and the copies take <= 1/8 of RAM;
    off: never; anything else is a clear error naming the variable."""
    ws = [torch.randn(64, 32), torch.randn(32, 64)]
    need = sum(w.numel() * 4 for w in ws)
    monkeypatch.delenv("KVSTRATA_CPU_F32_GEMV", raising=False)
    assert f32_gemv.worth_copies(ws, ram_bytes=need * 8) == HAS_AVX2
    assert not f32_gemv.worth_copies(ws, ram_bytes=need * 8 - 8)
    assert not f32_gemv.worth_copies(ws + [torch.randn(30, 32)], ram_bytes=1 << 40)
    assert not f32_gemv.worth_copies([w.bfloat16() for w in ws], ram_bytes=1 << 40)
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "scalar")
    assert not f32_gemv.worth_copies(ws, ram_bytes=1 << 40)
    monkeypatch.delenv("KVSTRATA_CPU_ISA")
    monkeypatch.setenv("KVSTRATA_CPU_F32_GEMV", "off")
    assert not f32_gemv.worth_copies(ws, ram_bytes=1 << 40)
    monkeypatch.setenv("KVSTRATA_CPU_F32_GEMV", "yes")
    with pytest.raises(ValueError, match="KVSTRATA_CPU_F32_GEMV"):
        f32_gemv.worth_copies(ws)


@pytest.mark.skipif(not HAS_AVX2, reason="the GEMV copies need AVX2 + FMA")
def test_packed_linear_takes_the_gemv_for_few_rows(monkeypatch):
    """A PackedLinear with the copy: up to max_rows() rows (16 on an AVX2-only CPU, 8 with
    AVX-512) through the GEMV, more through oneDNN's layer,
    both equal to F.linear; its bytes count the copy. KVSTRATA_CPU_ISA=scalar after packing
    sends every row count to oneDNN (no vector GEMV)."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    layer = PackedLinear(w, b, gemv=True)
    plain = PackedLinear(w, b)
    assert layer.gemv is not None and plain.gemv is None
    assert layer.nbytes == plain.nbytes + w.numel() * 4
    calls = []
    real = f32_gemv.linear
    monkeypatch.setattr(f32_gemv, "linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    took = []
    for m in (1, 4, 5, 8, 9, 16, 17, 32):
        x = torch.randn(m, 64, generator=g)
        before = len(calls)
        real_out = real(x, layer.gemv, layer.bias)
        took.append(real_out is not None)
        _close(packed_linear(x, layer), F.linear(x, w, b))
        assert len(calls) == before + 1  # asked each time
    limit = 8 if "avx512f" in read_cpu_flags() else 16
    assert f32_gemv.max_rows() == limit
    assert took == [m <= limit for m in (1, 4, 5, 8, 9, 16, 17, 32)]
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "scalar")
    assert real(torch.randn(1, 64), layer.gemv, layer.bias) is None


@pytest.mark.skipif(not HAS_AVX2, reason="the fp32 GEMM is AVX2 code")
@pytest.mark.parametrize("n,k", [(16, 2), (48, 30), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [17, 18, 23, 24, 31, 64, 128, 131])
def test_gemm_above_the_gemv_equals_f_linear(n, k, m):
    """kvstrata's fp32 GEMM over the GEMV's panels (rows above max_rows()): every tile height
    (row blocks of 5-6 rows, 1-4 where fewer), strided rows, with and without a bias; 1-3
    threads give the same values; the scalar ISA cap has no GEMM (None: oneDNN's layer);
    above GEMM_MAX_ROWS the layer keeps oneDNN's, the kernel still computes them."""
    g = torch.Generator().manual_seed(n + 3 * k + m)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(m, k + 6, generator=g)[:, 3:3 + k]
    panels = f32_gemv.pack(w)
    if m > f32_gemv.GEMM_MAX_ROWS:
        assert f32_gemv.linear(x, panels, b, cap=1, gemm=True) is None
        got = torch.empty(m, n)
        _bf16_ops.linear_f32(x.data_ptr(), x.stride(0), m, k, panels.data_ptr(), n,
                             b.data_ptr(), got.data_ptr(), 2, 1)
        _close(got, F.linear(x, w, b))
        return
    for bias in (b, None):
        got = f32_gemv.linear(x, panels, bias, cap=1, gemm=True)
        assert got.shape == (m, n) and got.dtype == torch.float32
        _close(got, F.linear(x, w, bias))
    outs = []
    for threads in (1, 2, 3):
        out = torch.empty(m, n)
        fn, args = f32_gemv.gemv_call(x, panels, b, out, threads=threads, cap=1, gemm=True)
        assert fn is _bf16_ops.linear_f32 or m <= f32_gemv.max_rows()
        fn(*args)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert f32_gemv.linear(x, panels, b, cap=0, gemm=True) is None or m <= f32_gemv.max_rows()


def test_gemm_refuses_bad_shapes():
    out = torch.empty(17, 32)
    panels = f32_gemv.pack(torch.randn(32, 8))
    for k, n in ((7, 32), (8, 24)):  # odd in, out not a multiple of 16
        with pytest.raises(ValueError, match="bad shape"):
            _bf16_ops.linear_f32(0, k, 17, k, panels.data_ptr(), n, 0, out.data_ptr(), 1, 1)


@pytest.mark.skipif(not HAS_AVX2, reason="the GEMV copies need AVX2 + FMA")
def test_layers_take_the_gemm_above_the_gemv_by_the_rule(monkeypatch):
    """KVSTRATA_CPU_F32_GEMV=auto on a CPU without AVX-512: a layer with the copy takes the
    fp32 GEMM for more rows than the GEMV's (packed_linear, equal to F.linear); gemv: oneDNN's
    layer there, as before the GEMM; with AVX-512 auto keeps oneDNN's there too."""
    g = torch.Generator().manual_seed(9)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    monkeypatch.delenv("KVSTRATA_CPU_F32_GEMV", raising=False)
    layer = PackedLinear(w, b, gemv=True)
    assert layer.gemm_f32 == ("avx512f" not in read_cpu_flags())
    monkeypatch.setenv("KVSTRATA_CPU_F32_GEMV", "gemv")
    assert f32_gemv.worth_copies([w], ram_bytes=1 << 40)
    gemv_only = PackedLinear(w, b, gemv=True)
    assert gemv_only.gemv is not None and not gemv_only.gemm_f32
    calls = []
    real = _bf16_ops.linear_f32
    monkeypatch.setattr(_bf16_ops, "linear_f32", lambda *a: calls.append(a[2]) or real(*a))
    x = torch.randn(40, 64, generator=g)
    _close(packed_linear(x, layer), F.linear(x, w, b))
    _close(packed_linear(x, gemv_only), F.linear(x, w, b))
    assert calls == ([40] if layer.gemm_f32 else [])
