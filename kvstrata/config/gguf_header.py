"""A GGUF file's header, read without the gguf library (no numpy, no torch): the metadata
values of the keys asked for, and the tensor table.

gguf.GGUFReader parses every metadata field element by element through numpy memmap
slices -- for SmolLM2 its 49k-entry vocabulary costs ~5 s (more on a busy 2-core box), on
every server start, for values nobody here reads. This walks the header and steps over the
values it is not asked for by their encoded lengths. The weight loader reads the tensor table
(runner/models/gguf_index.py hands out the data); the config conversion reads the few
hyper-parameters transformers' GGUF conversion drops (config/gguf_config.py).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian v2/v3).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"GGUF"
# Metadata value type -> struct format of one element (8: string, 9: array are variable).
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
            11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ne, fastest-varying first (as GGUF stores it)
    tensor_type: int       # gguf.GGMLQuantizationType value
    offset: int            # from the start of the data section


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # the keys asked for that the file has (and general.alignment)
    tensors: list[TensorInfo] = field(default_factory=list)
    data_start: int = 0       # byte offset of the data section (aligned)


class _Cursor:
    def __init__(self, buf):
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

    def value(self, vtype: int) -> Any:
        if vtype in _FORMATS:
            return self.unpack(_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("IQ")
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"GGUF: unknown metadata value type {vtype}")

    def skip_value(self, vtype: int) -> None:
        if vtype in _FORMATS:
            self.pos += struct.calcsize(_FORMATS[vtype])
        elif vtype == _STRING:
            n = self.unpack("Q")  # (not `pos += unpack()`: that reads pos before unpack moves it)
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.unpack("IQ")
            if etype in _FORMATS:
                self.pos += struct.calcsize(_FORMATS[etype]) * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise ValueError(f"GGUF: unknown metadata value type {vtype}")


def parse_header(buf, path: str, keys=frozenset()) -> GGUFHeader:
    """The header of a GGUF file whose bytes are `buf` (a memoryview / mmap / bytes);
    `keys`: the metadata keys to decode."""
    if bytes(buf[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cur = _Cursor(buf)
    cur.pos = 4
    version, n_tensors, n_kv = cur.unpack("IQQ")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (need >= 2)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.unpack("I")
        if key in keys or key == "general.alignment":
            metadata[key] = cur.value(vtype)
        else:
            cur.skip_value(vtype)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        dims = tuple(cur.unpack(f"{n_dims}Q")) if n_dims > 1 else (cur.unpack("Q"),)
        ttype, offset = cur.unpack("IQ")
        tensors.append(TensorInfo(name, dims, ttype, offset))
    return GGUFHeader(version, metadata, tensors, -(-cur.pos // alignment) * alignment)


def read_header(path: str, keys=()) -> GGUFHeader:
    """The file's header: the values of these metadata keys that it has, its tensor table."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            return parse_header(view, path, frozenset(keys))
        finally:
            view.release()


def read_metadata(path: str, keys) -> dict[str, Any]:
    """The values of these metadata keys that the file has (strings, numbers, arrays)."""
    return read_header(path, keys).metadata


def arch_getters(meta: dict[str, Any], arch: str):
    """(get, need) over the `arch.`-prefixed keys of `meta`: get(key, default) its value or
    the default; need(key) its value, or a ValueError naming the key llama.cpp requires."""

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ValueError(f"GGUF {arch}: no {arch}.{key} (llama.cpp requires it)")
        return value

    return get, need


YARN_BETAS = (32.0, 1.0)  # llama.cpp's yarn_beta_fast / yarn_beta_slow defaults


def yarn_parameters(get, base: float, original: int) -> dict[str, Any]:
    """transformers' YaRN rope parameters from llama.cpp's keys (`get`: arch_getters')."""
    fast, slow = YARN_BETAS
    return {"rope_type": "yarn", "rope_theta": base,
            "factor": float(get("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(original),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", fast)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", slow))}


__all__ = ["GGUFHeader", "TensorInfo", "YARN_BETAS", "arch_getters", "parse_header",
           "read_header", "read_metadata", "yarn_parameters"]
