"""A weight matrix kept in a quantized block format, as the checkpoint stores it.

`PackedRows` is what the loader hands a model instead of a float tensor when the weights
stay quantized (`--quantization gguf`; GPTQ / AWQ int4 converted to the same block rows):
`raw` holds one output channel per row, its blocks along the input dimension in the GGUF
block layout of `qtype` (a gguf.GGMLQuantizationType value). Rows are independent, so a
model fuses projections (q|k|v, gate|up) and a tensor-parallel rank takes its share by
slicing rows, never touching the blocks. `input_perm` (GPTQ act-order): the input columns
the blocks are laid out in; a layer gathers x's columns in that order before multiplying.

The matmul itself is runner/cpu/gguf_matmul.py's (kernels that read the blocks packed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    qtype: int              # gguf.GGMLQuantizationType value of every block in `raw`
    raw: torch.Tensor       # uint8 [rows, row_bytes]
    cols: int               # the input dimension K (values per row)
    input_perm: torch.Tensor | None = None  # int64 [cols]: x[:, input_perm] meets the blocks

    def __post_init__(self):
        if self.raw.dtype != torch.uint8 or self.raw.dim() != 2:
            raise ValueError(f"PackedRows.raw must be uint8 [rows, row_bytes], got "
                             f"{self.raw.dtype} {tuple(self.raw.shape)}")
        if self.input_perm is not None and tuple(self.input_perm.shape) != (self.cols,):
            raise ValueError(f"PackedRows.input_perm must have {self.cols} entries")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return self.raw.numel() + (0 if self.input_perm is None else self.input_perm.numel() * 8)

    def rows(self, lo: int, hi: int) -> "PackedRows":
        """Output channels lo..hi (a view: no copy)."""
        return PackedRows(self.qtype, self.raw[lo:hi], self.cols, self.input_perm)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols] in the checkpoint's column order (input_perm undone)."""
        from kvstrata.runner.cpu import gguf_matmul

        w = gguf_matmul.dequantize(gguf_matmul.prepare(self.qtype, self.raw))
        if self.input_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.input_perm] = w
        return out


__all__ = ["PackedRows"]
