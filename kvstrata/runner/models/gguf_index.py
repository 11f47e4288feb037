"""The tensor index of a GGUF file (name, type, shape, data), read without parsing its
metadata values.

gguf.GGUFReader parses every metadata field element by element through numpy memmap
slices -- for SmolLM2 its 49k-entry vocabulary costs ~5 s (more on a busy 2-core box),
on every server start, for values the weight loader never reads (the config and tokenizer
come from the converted metadata directory, config/model_source.py). This walks the header,
steps over the metadata values by their encoded lengths, reads the tensor infos and hands
out each tensor's bytes as a numpy view of the memory-mapped file, shaped as GGUFReader
shapes them (so gguf.quants.dequantize, the library's own, reads them unchanged).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian v2/v3).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

_MAGIC = b"GGUF"
# Metadata value types -> fixed byte size (8: string, 9: array are variable).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int       # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # ne, fastest-varying first (as GGUF stores it)
    data: np.ndarray        # raw, numpy shape = reversed ne (bytes in the last dim if quantized)


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        n = self.unpack("Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def skip_value(self, vtype: int) -> None:
        if vtype in _FIXED:
            self.pos += _FIXED[vtype]
        elif vtype == _STRING:
            n = self.unpack("Q")  # (not `pos += unpack()`: that reads pos before unpack moves it)
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.unpack("IQ")
            if etype in _FIXED:
                self.pos += _FIXED[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise ValueError(f"GGUF: unknown metadata value type {vtype}")


def read_gguf_tensors(path: str) -> list[GGUFTensor]:
    """Every tensor of the file, in file order, its data a read-only view of the mapping."""
    import gguf  # the library's type table (block sizes, numpy types)

    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(memoryview(mm))
    if bytes(cur.buf[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version, n_tensors, n_kv = cur.unpack("IQQ")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (need >= 2)")
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.unpack("I")
        if key == "general.alignment" and vtype == 4:
            alignment = cur.unpack("I")
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        dims = tuple(cur.unpack(f"{n_dims}Q")) if n_dims > 1 else (cur.unpack("Q"),)
        ttype, offset = cur.unpack("IQ")
        infos.append((name, dims, ttype, offset))
    data_start = -(-cur.pos // alignment) * alignment
    raw = np.frombuffer(mm, dtype=np.uint8)
    T = gguf.GGMLQuantizationType
    # GGUFReader's element types; every other type is raw bytes in block rows.
    plain = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64, T.I8: np.int8,
             T.I16: np.int16, T.I32: np.int32, T.I64: np.int64}
    tensors = []
    for name, dims, ttype, offset in infos:
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
