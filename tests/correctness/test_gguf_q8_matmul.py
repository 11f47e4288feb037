"""GGUF weights kept quantized times 8-bit activations (runner/cpu/gguf_matmul.py `matmul_q8`,
csrc/gguf_q8_blocks.h): what a GGUF file's layers run.

Reference (numpy, float64): x's rows quantized the same way, written here from the scheme
(per block of 32, or of 256 for the K-quants' super-block path, gguf_q8k_run.h: d = amax / 127
in fp32, q = round-half-even(x / d) via x * (1 / d)), times
the weights as the `gguf` package dequantizes them (gguf.quants.dequantize, not ours). The
kernel's result differs from that exact product only by fp32 rounding: per group one scale
product (w_scale * d) and one FMA per lane, k / 32 groups in a lane, an 8-lane tree and the
min term, so the error is held to (k / 32 + 8) * 2^-23 * (|x_q| @ |W|.T) (measured: at most
0.02 of it, the min formats' split w_scale * q + w_min included).

Also: the quantized activations are close to x itself (the price of the speed: within 0.4%
of |x| @ |W|.T here, 0.1-0.2% measured) and the portable C body gives the AVX2 body's bits.
Batch invariance (rows 1..64 and 333, one and two threads): test_gguf_matmul.py's
test_rows_are_batch_invariant, parametrized over both kernels."""
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


def in_features(qtype: int) -> int:
    return 512 if gguf_matmul.BLOCKS[qtype][1] == 256 else 608


def activation_block(qtype: int) -> int:
    """Values per activation scale matmul_q8 uses for a weight format (the K-quants: their
    super-block, gguf_q8k_run.h)."""
    return gguf_matmul.BLOCKS[qtype][1]


def q8_reference(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x fp32 [m, k] -> its 8-bit blocks of `block` values dequantized, float64 (exact: d * q)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, block)
    d = np.abs(blocks).max(-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127)
    return (q.astype(np.float64) * d[..., None].astype(np.float64)).reshape(x.shape)


def check_q8(out: torch.Tensor, x: torch.Tensor, w: np.ndarray, block: int = 32) -> None:
    xq = q8_reference(x.float().numpy(), block)
    exact = xq @ w.astype(np.float64).T
    k = w.shape[1]
    bound = (np.abs(xq) @ np.abs(w.astype(np.float64)).T) * (k / 32 + 8) * 2.0 ** -23
    err = np.abs(out.double().numpy() - exact)
    assert bool((err <= bound + 1e-30).all()), (err / bound).max()


@pytest.fixture(scope="module")
def weights() -> dict:
    """qtype -> (raw gguf-quantized rows where gguf can, random blocks too, dequantized)."""
    rng = np.random.default_rng(64)
    out = {}
    for q in FORMATS:
        raw = weight_rows(q, N, in_features(q), rng)
        noise = random_blocks(q, 9, in_features(q), rng)
        deq = [quants.dequantize(r.numpy(), GGMLQuantizationType(q)) for r in (raw, noise)]
        out[q] = (raw, noise, *deq)
    return out


@needs_avx2
@pytest.mark.parametrize("qtype", FORMATS, ids=NAMES)
def test_matches_quantized_activations_times_gguf_weights(qtype, weights):
    raw, noise, ref, noise_ref = weights[qtype]
    w, wn = gguf_matmul.prepare(qtype, raw), gguf_matmul.prepare(qtype, noise)
    torch.manual_seed(qtype)
    for m in (1, 2, 3, 4, 65):
        x = torch.randn(m, w.in_features)
        x[0, :32] = 0.0  # an all-zero block: d = 0
        block = activation_block(qtype)
        check_q8(gguf_matmul.matmul_q8(x, w), x, ref, block)
        check_q8(gguf_matmul.matmul_q8(x.bfloat16(), w), x.bfloat16(), ref, block)
        check_q8(gguf_matmul.matmul_q8(x, wn), x, noise_ref, block)
    # the activation rounding itself: close to the float product (what matmul gives)
    x = torch.randn(8, w.in_features)
    exact = x.double().numpy() @ ref.astype(np.float64).T
    scale = np.abs(x.double().numpy()) @ np.abs(ref.astype(np.float64)).T
    got = gguf_matmul.matmul_q8(x, w).double().numpy()
    assert float((np.abs(got - exact) / scale).max()) < 0.004


@pytest.mark.parametrize("qtype", FORMATS, ids=NAMES)
def test_portable_body_gives_the_avx2_bits(qtype, weights, monkeypatch):
    raw, noise, ref, _ = weights[qtype]
    w = gguf_matmul.prepare(qtype, raw)
    torch.manual_seed(qtype)
    x = torch.randn(70, w.in_features) * 3
    fast = (gguf_matmul.matmul_q8(x, w), gguf_matmul.matmul_q8(x, gguf_matmul.prepare(qtype, noise))
            ) if AVX2 else None
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "scalar")
    slow = gguf_matmul.matmul_q8(x, w)
    check_q8(slow, x, ref, activation_block(qtype))
    for m in (1, 4, 64):
        assert torch.equal(gguf_matmul.matmul_q8(x[:m], w), slow[:m])
    if AVX2:
        assert torch.equal(slow, fast[0])
        assert torch.equal(gguf_matmul.matmul_q8(x, gguf_matmul.prepare(qtype, noise)), fast[1])


@pytest.mark.skipif(not gguf_matmul.has_vnni(3), reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("qtype", FORMATS, ids=NAMES)
def test_vnni_body_gives_the_avx2_bits(qtype, weights, monkeypatch):
    """KVSTRATA_CPU_ISA=auto on an AVX-512 VNNI CPU (vpdpbusd) against =avx2 (vpmaddubsw +
    vpmaddwd): the same exact integer lanes, so the same bits at every row count."""
    raw, noise, ref, noise_ref = weights[qtype]
    torch.manual_seed(qtype)
    x = torch.randn(67, in_features(qtype)) * 3
    x[1, 32:64] = 0.0
    for rows, deq in ((raw, ref), (noise, noise_ref)):
        w = gguf_matmul.prepare(qtype, rows)
        monkeypatch.setenv("KVSTRATA_CPU_ISA", "auto")
        assert gguf_matmul.has_vnni()
        fast = gguf_matmul.matmul_q8(x, w)
        check_q8(fast, x, deq, activation_block(qtype))
        monkeypatch.setenv("KVSTRATA_CPU_ISA", "avx2")
        assert not gguf_matmul.has_vnni()
        for m in (1, 2, 5, 67):
            assert torch.equal(gguf_matmul.matmul_q8(x[:m], w), fast[:m])
