"""The tensor index of a GGUF file (name, type, shape, data), read without parsing its
metadata values (config/gguf_header.py walks the header: why there).

Each tensor's bytes are a numpy view of the memory-mapped file, shaped as gguf.GGUFReader
shapes them (so gguf.quants.dequantize, the library's own, reads them unchanged).
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from kvstrata.config.gguf_header import parse_header


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int       # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # ne, fastest-varying first (as GGUF stores it)
    data: np.ndarray        # raw, numpy shape = reversed ne (bytes in the last dim if quantized)


def read_gguf_tensors(path: str) -> list[GGUFTensor]:
    """Every tensor of the file, in file order, its data a read-only view of the mapping."""
    import gguf  # the library's type table (block sizes, numpy types)

    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    header = parse_header(memoryview(mm), path)
    data_start = header.data_start
    raw = np.frombuffer(mm, dtype=np.uint8)
    T = gguf.GGMLQuantizationType
    # GGUFReader's element types; every other type is raw bytes in block rows.
    plain = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64, T.I8: np.int8,
             T.I16: np.int16, T.I32: np.int32, T.I64: np.int64}
    tensors = []
    for info in header.tensors:
        name, dims, ttype, offset = info.name, info.dims, info.tensor_type, info.offset
        qtype = T(ttype)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        np_shape = tuple(reversed(dims))
        n_bytes = int(np.prod(dims)) * type_size // block
        chunk = raw[data_start + offset:data_start + offset + n_bytes]
        if qtype in plain:
            data = chunk.view(plain[qtype]).reshape(np_shape)
        else:
            data = chunk.reshape(gguf.quant_shape_to_byte_shape(np_shape, qtype))
        tensors.append(GGUFTensor(name, int(ttype), dims, data))
    return tensors


__all__ = ["GGUFTensor", "read_gguf_tensors"]
