"""GGUF weights kept quantized (runner/cpu/gguf_matmul.py, csrc/gguf_ops.c) against the `gguf`
package's own dequantizer (gguf.quants.dequantize, which we did not write) and float64
arithmetic: dequantize() and matmul() (x kept float); matmul_q8() (8-bit activations, what
a GGUF file's layers run) in test_gguf_q8_matmul.py, and in the batch-invariance test here.

- dequantize(): gguf.quants.dequantize's values bit for bit, on gguf-quantized normals and on
  random blocks (every nibble, high bit and 6-bit scale pattern);
- matmul(): within fp32 accumulation error of float64 dequantize(w) @ x: every output is an
  fp32 sum of K fp32 products (x exactly, or x's bf16 values, times the exact weights), so
  |out - exact| <= K * 2^-23 * (|x| @ |W|.T) (the standard bound, K * u with u = 2^-24, twice);
- batch invariance: a row's result is the same bits whatever M and the thread count;
- the strided `out` view, the portable C body (KVSTRATA_CPU_ISA=scalar: the AVX2 body's bits),
  and refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kvstrata.bench.gguf_blocks import random_blocks, weight_rows
from kvstrata.runner.cpu import gguf_matmul

AVX2 = gguf_matmul._own(1)
needs_avx2 = pytest.mark.skipif(not AVX2, reason="the GGUF kernels need AVX2 + FMA + F16C")
FORMATS = sorted(gguf_matmul.SUPPORTED)
NAMES = [GGMLQuantizationType(q).name for q in FORMATS]
N = 37  # odd: a last quad of one column
PREFILL = 333  # rows of a prompt


def in_features(qtype: int) -> int:
    """Not a multiple of 256 where the format allows (19 blocks of 32), else 2 super-blocks."""
    return 512 if gguf_matmul.BLOCKS[qtype][1] == 256 else 608


def reference(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw.numpy(), GGMLQuantizationType(qtype)).copy())


def assert_within_fp32_sum(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * x.shape[1] * 2.0 ** -23 + 1e-30
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), (err / bound).max()


@pytest.fixture(scope="module")
def weights() -> dict:
    """qtype -> (raw rows, gguf's dequantized fp32 values): gguf-quantized where it can."""
    rng = np.random.default_rng(64)
    out = {}
    for q in FORMATS:
        raw = weight_rows(q, N, in_features(q), rng)
        out[q] = (raw, reference(raw, q))
    return out


@needs_avx2
@pytest.mark.parametrize("qtype", FORMATS, ids=NAMES)
def test_dequantize_is_gguf_bit_for_bit(qtype, weights):
    raw, ref = weights[qtype]
    assert torch.equal(gguf_matmul.dequantize(gguf_matmul.prepare(qtype, raw)), ref)
    noise = random_blocks(qtype, 9, in_features(qtype), np.random.default_rng(qtype))
    w = gguf_matmul.prepare(qtype, noise)
    assert (w.out_features, w.in_features, w.nbytes) == (9, in_features(qtype), noise.numel())
    assert torch.equal(gguf_matmul.dequantize(w), reference(noise, qtype))


@needs_avx2
@pytest.mark.parametrize("qtype", FORMATS, ids=NAMES)
def test_matmul_within_fp32_sum_of_dequantized(qtype, weights):
    """Rows 1-2 (registers), 3+ (panels: tiles of 3 rows and their 1-2 row tails), 65 and 130
    (a second block of 64 rows) and PREFILL; fp32 and bf16 x."""
    raw, ref = weights[qtype]
    w = gguf_matmul.prepare(qtype, raw)
    torch.manual_seed(qtype)
    for m in (1, 2, 3, 32, 65, PREFILL):
        x = torch.randn(m, w.in_features)
        assert_within_fp32_sum(gguf_matmul.matmul(x, w), x, ref)
        xb = x.bfloat16()
        assert_within_fp32_sum(gguf_matmul.matmul(xb, w), xb.float(), ref)


@needs_avx2
@pytest.mark.parametrize("kernel", ["matmul_q8", "matmul"], ids=["int8_act", "float_act"])
@pytest.mark.parametrize("qtype", FORMATS, ids=NAMES)
def test_rows_are_batch_invariant(qtype, kernel, weights):
    """Every row count 1..64 (decode batches) and PREFILL rows (a prompt: five blocks of 64
    and a tail) give each row the same bits as the prefill-size call, and row i alone does
    too, on one thread and on two (one summation order per output on every path), with 8-bit
    activations (matmul_q8: test_gguf_q8_matmul.py) and with float ones (matmul)."""
    mm = getattr(gguf_matmul, kernel)
    w = gguf_matmul.prepare(qtype, weights[qtype][0])
    torch.manual_seed(1)
    x = torch.randn(PREFILL, w.in_features)
    full = mm(x, w)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(mm(x, w), full)
            for m in range(1, 65):
                assert torch.equal(mm(x[:m], w), full[:m]), m
            for i in (1, 64, 200, PREFILL - 1):
                assert torch.equal(mm(x[i:i + 1], w)[0], full[i])
            assert torch.equal(mm(x[62:65], w), full[62:65])
    finally:
        torch.set_num_threads(threads)


@needs_avx2
@pytest.mark.parametrize("qtype", [2, 12], ids=["Q4_0", "Q4_K"])
def test_out_may_be_a_column_slice(qtype, weights):
    """Two formats written side by side into one wider output (a fused layer's segments)."""
    w = gguf_matmul.prepare(qtype, weights[qtype][0])
    other = gguf_matmul.prepare(8, weight_rows(8, 5, w.in_features, np.random.default_rng(3)))
    for m in (1, 7):
        x = torch.randn(m, w.in_features)
        wide = torch.full((m, 3 + N + 5 + 2), 7.0)
        assert gguf_matmul.matmul(x, w, wide[:, 3:3 + N]) is not None
        gguf_matmul.matmul(x, other, wide[:, 3 + N:3 + N + 5])
        assert torch.equal(wide[:, 3:3 + N], gguf_matmul.matmul(x, w))
        assert torch.equal(wide[:, 3 + N:3 + N + 5], gguf_matmul.matmul(x, other))
        assert bool((wide[:, :3] == 7).all() and (wide[:, -2:] == 7).all())


@needs_avx2
def test_leading_dims_are_rows(weights):
    """x [..., K] as torch.matmul takes it: the rows of x.reshape(-1, K)."""
    w = gguf_matmul.prepare(3, weights[3][0])
    x = torch.randn(2, 3, w.in_features)
    y = gguf_matmul.matmul(x, w)
    assert y.shape == (2, 3, N)
    assert torch.equal(y.reshape(6, N), gguf_matmul.matmul(x.reshape(6, -1), w))


@pytest.mark.parametrize("qtype", FORMATS, ids=NAMES)
def test_portable_body_gives_the_avx2_bits(qtype, weights, monkeypatch):
    """KVSTRATA_CPU_ISA=scalar (what a CPU without AVX2 + FMA + F16C runs): gguf's values bit
    for bit, products within the fp32 bound, batch-invariant, and, where the AVX2 body runs
    too, exactly its bits (the same operations in the same order, in plain C)."""
    raw, ref = weights[qtype]
    w = gguf_matmul.prepare(qtype, raw)
    torch.manual_seed(qtype)
    x = torch.randn(70, w.in_features)
    fast = gguf_matmul.matmul(x, w) if AVX2 else None
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "scalar")
    assert gguf_matmul.kernel_name() == gguf_matmul.FALLBACK_KERNEL
    assert torch.equal(gguf_matmul.dequantize(w), ref)
    noise = random_blocks(qtype, 9, in_features(qtype), np.random.default_rng(qtype))
    assert torch.equal(gguf_matmul.dequantize(gguf_matmul.prepare(qtype, noise)),
                       reference(noise, qtype))
    slow = gguf_matmul.matmul(x, w)
    assert_within_fp32_sum(slow, x, ref)
    for m in (1, 2, 3, 64):
        assert torch.equal(gguf_matmul.matmul(x[:m], w), slow[:m])
    out = torch.zeros(2, N + 1)
    gguf_matmul.matmul(x[68:], w, out[:, 1:])
    assert torch.equal(out[:, 1:], slow[68:])
    if AVX2:
        assert torch.equal(slow, fast)
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "auto")
    name = gguf_matmul.kernel_name()
    if AVX2:  # the 8-bit-activation kernel's AVX-512 VNNI body is named where it runs
        assert name.startswith(gguf_matmul.AVX2_KERNEL)
        assert ("AVX-512 VNNI" in name) == gguf_matmul.has_vnni(), name
    else:
        assert name == gguf_matmul.FALLBACK_KERNEL


def test_sizes_and_refusals(weights):
    assert gguf_matmul.row_bytes(2, 608) == 19 * 18
    assert gguf_matmul.row_bytes(14, 512) == 2 * 210
    assert gguf_matmul.supported(12) and not gguf_matmul.supported(10)  # Q2_K: not built
    with pytest.raises(ValueError, match="type 10"):
        gguf_matmul.prepare(10, torch.zeros(4, 84, dtype=torch.uint8))
    with pytest.raises(ValueError, match="256-weight|multiple"):
        gguf_matmul.row_bytes(12, 576)  # K-quants: whole super-blocks only
    with pytest.raises(ValueError, match="whole"):
        gguf_matmul.prepare(2, torch.zeros(4, 19, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        gguf_matmul.prepare(2, torch.zeros(4, 18))
    w = gguf_matmul.prepare(2, weights[2][0])
    with pytest.raises(ValueError, match="in_features"):
        gguf_matmul.matmul(torch.zeros(1, 32), w)
    with pytest.raises(ValueError, match="out must be"):
        gguf_matmul.matmul(torch.zeros(2, w.in_features), w, torch.zeros(N, 2).T)
    assert gguf_matmul.matmul(torch.zeros(0, w.in_features), w).shape == (0, N)


def test_packed_rows_dequantize_through_the_kernel(weights):
    """runner/quant/packed_rows.py's PackedRows (what the loader hands a model) on these
    functions: row slices and the act-order permutation undone."""
    from kvstrata.runner.quant.packed_rows import PackedRows
    raw, ref = weights[12]
    rows = PackedRows(12, raw, ref.shape[1])
    assert torch.equal(rows.dequantize(), ref)
    assert torch.equal(rows.rows(5, 9).dequantize(), ref[5:9])
    perm = torch.randperm(ref.shape[1], generator=torch.Generator().manual_seed(0))
    undone = PackedRows(12, raw, ref.shape[1], perm).dequantize()
    assert torch.equal(undone[:, perm], ref)
