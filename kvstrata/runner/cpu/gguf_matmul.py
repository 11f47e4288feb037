"""x @ W.T with W in GGUF quantized blocks (runner/quant/packed_rows.py's rows).

This is the portable path: dequantize with the `gguf` library (its values exactly) and
multiply in float32. Correct everywhere, slow (it dequantizes the whole weight per call);
the CPU kernels that read the blocks packed replace `matmul` where the ISA allows them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def _types() -> dict[str, int]:
    import gguf

    T = gguf.GGMLQuantizationType
    return {t.name: int(t) for t in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)}


SUPPORTED: frozenset[int] = frozenset(_types().values())
KERNEL = "gguf.quants.dequantize + float32 F.linear (portable path)"


def supported(qtype: int) -> bool:
    return int(qtype) in SUPPORTED


def row_bytes(qtype: int, cols: int) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    if cols % block:
        raise ValueError(f"{gguf.GGMLQuantizationType(qtype).name}: {cols} columns is not a "
                         f"multiple of its block of {block}")
    return cols // block * size


@dataclass(frozen=True)
class PreparedWeight:
    qtype: int
    raw: torch.Tensor  # uint8 [N, row_bytes]
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


def prepare(qtype: int, raw: torch.Tensor) -> PreparedWeight:
    import gguf

    if not supported(qtype):
        raise ValueError(f"GGUF type {gguf.GGMLQuantizationType(qtype).name} has no kernel "
                         f"(built: {', '.join(sorted(_types()))})")
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(f"raw blocks must be uint8 [N, k * {size}], got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    return PreparedWeight(int(qtype), raw, raw.shape[0], raw.shape[1] // size * block)


def dequantize(w: PreparedWeight) -> torch.Tensor:
    import gguf

    data = np.ascontiguousarray(w.raw.numpy())
    values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(w.qtype))
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True))


def matmul(x: torch.Tensor, w: PreparedWeight, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    y = torch.matmul(x.float(), dequantize(w).t())
    if out is None:
        return y
    out.copy_(y)
    return out


def kernel_name() -> str:
    return KERNEL


__all__ = ["SUPPORTED", "PreparedWeight", "dequantize", "kernel_name", "matmul", "prepare",
           "row_bytes", "supported"]
