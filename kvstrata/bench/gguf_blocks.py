"""Random GGUF weight rows in the block formats runner/cpu/gguf_matmul.py multiplies, for its
tests and benchmarks/bench_gguf_linear.py: gguf's own quantizer where the `gguf` package has
one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), else random blocks. Every byte pattern is a valid block
once its f16 scales are finite, so random bytes with small random scales exercise every
nibble, high bit and 6-bit scale of Q4_K / Q5_K / Q6_K (whose quantizers gguf 0.19 lacks)."""
from __future__ import annotations

import numpy as np
import torch

# where each format keeps its f16 scales: (first byte, how many f16), per block
F16_FIELDS = {2: (0, 1), 3: (0, 2), 6: (0, 1), 7: (0, 2), 8: (0, 1), 12: (0, 2), 13: (0, 2),
              14: (208, 1)}


def quantized(qtype: int, weights: np.ndarray) -> torch.Tensor:
    """fp32 [n, k] -> uint8 [n, row_bytes] by gguf.quants.quantize."""
    from gguf import GGMLQuantizationType, quants
    return torch.from_numpy(np.ascontiguousarray(
        quants.quantize(weights.astype(np.float32), GGMLQuantizationType(qtype))))


def random_blocks(qtype: int, n: int, k: int, rng: np.random.Generator,
                  scale: float = 2e-3) -> torch.Tensor:
    """uint8 [n, row_bytes]: random bytes, the f16 scales set to random values in
    (-scale, scale) (signed: gguf's formats never assume a sign)."""
    from kvstrata.runner.cpu.gguf_matmul import BLOCKS
    block_bytes, block_values = BLOCKS[qtype]
    blocks = rng.integers(0, 256, (n, k // block_values, block_bytes), dtype=np.uint8)
    at, count = F16_FIELDS[qtype]
    f16 = ((rng.random((n, k // block_values, count)) * 2 - 1) * scale).astype(np.float16)
    blocks[..., at:at + 2 * count] = f16.view(np.uint8)
    return torch.from_numpy(blocks.reshape(n, -1))


def weight_rows(qtype: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """gguf's quantizer on random normals (std 1 / sqrt(k)) where it has one, else
    random_blocks."""
    try:
        return quantized(qtype, rng.standard_normal((n, k)) / k ** 0.5)
    except NotImplementedError:
        return random_blocks(qtype, n, k, rng)
