"""The K-quants (Q4_K, Q5_K, Q6_K) times 8-bit activations on super-blocks of 256 with integer
sub-block scales (runner/cpu/csrc/gguf_q8k_run.h, gguf_matmul.matmul_q8's default for them).

References we did not write: the weights as the `gguf` package dequantizes them
(gguf.quants.dequantize) times x in torch (float64 matmul), and x quantized per 256 values from
the scheme (test_gguf_q8_matmul.q8_reference). The exact-activation bound, the portable and
VNNI bodies' bits and batch invariance are in test_gguf_q8_matmul.py / test_gguf_matmul.py
(parametrized over every format, so they run this path); here: the float product, the old
32-block path (KVSTRATA_GGUF_Q8_SUPERBLOCKS=0) it replaces, and activations that stress the
coarser blocks (an outlier per super-block, zero super-blocks, bf16)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kvstrata.bench.gguf_blocks import random_blocks
from kvstrata.runner.cpu import gguf_matmul
from tests.correctness.test_gguf_q8_matmul import check_q8, needs_avx2

K_QUANTS = [12, 13, 14]
NAMES = [GGMLQuantizationType(q).name for q in K_QUANTS]
K, N = 768, 21  # three super-blocks; a last quad of one column


@pytest.fixture(scope="module")
def weights() -> dict:
    """qtype -> (prepared weight, gguf-dequantized float64 [N, K] as torch)."""
    rng = np.random.default_rng(640)
    out = {}
    for q in K_QUANTS:
        raw = random_blocks(q, N, K, rng)
        deq = quants.dequantize(raw.numpy(), GGMLQuantizationType(q)).astype(np.float64)
        out[q] = (gguf_matmul.prepare(q, raw), torch.from_numpy(deq))
    return out


@pytest.fixture
def superblocks_off():
    """Runs the test body's marked calls on the 32-block path; restores the default after."""
    yield lambda on: gguf_matmul.use_superblocks(on)
    gguf_matmul.use_superblocks(True)


def activations(seed: int, m: int) -> torch.Tensor:
    """Rows a decoder feeds a linear: normal values, one row with an outlier per super-block
    (the coarse block's worst case), one all-zero super-block (d = 0)."""
    torch.manual_seed(seed)
    x = torch.randn(m, K)
    x[0, 256:512] = 0.0
    x[-1, ::256] = 40.0
    return x


def float_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |got - x @ W.T| / (|x| @ |W|.T), in float64 with torch's matmul."""
    x = x.double()
    return float(((got.double() - x @ w.T).abs() / (x.abs() @ w.abs().T)).max())


@needs_avx2
@pytest.mark.parametrize("qtype", K_QUANTS, ids=NAMES)
def test_close_to_gguf_float_product_and_to_the_32_block_path(qtype, weights, superblocks_off):
    w, ref = weights[qtype]
    for m in (1, 3, 4, 9):
        x = activations(qtype + m, m)
        new = gguf_matmul.matmul_q8(x, w)
        check_q8(new, x, ref.numpy(), 256)
        superblocks_off(False)
        old = gguf_matmul.matmul_q8(x, w)
        superblocks_off(True)
        check_q8(old, x, ref.numpy(), 32)
        # rounding x per 256 values is coarser than per 32; the outlier row (40 against
        # normals: its blocks' other values round to few levels) sees it most. Measured here:
        # 32-block <= 0.8% of |x| @ |W|, 256-block <= 1.9% on the outlier row, <= 0.18% on
        # the others
        assert float_error(old, x, ref) < 0.012
        if m > 1:
            assert float_error(new[:-1], x[:-1], ref) < 0.004
        assert float_error(new, x, ref) < 0.03
        assert not torch.equal(new, old)  # the switch reaches the kernel
        xb = x.bfloat16()
        check_q8(gguf_matmul.matmul_q8(xb, w), xb.float(), ref.numpy(), 256)


@needs_avx2
@pytest.mark.parametrize("qtype", K_QUANTS, ids=NAMES)
def test_super_block_scales_reach_their_groups(qtype, weights):
    """Each group's own integer scale (and min): weights whose eight groups have different
    scales, against x that is nonzero in one group at a time, so a scale applied to the wrong
    group or half cannot cancel out."""
    w, ref = weights[qtype]
    for g in range(K // 32):
        x = torch.zeros(2, K)
        x[0, 32 * g:32 * g + 32] = torch.linspace(-1, 1, 32)
        x[1, 32 * g + 16:32 * g + 32] = 1.0  # Q6_K: only the group's second scale
        check_q8(gguf_matmul.matmul_q8(x, w), x, ref.numpy(), 256)
