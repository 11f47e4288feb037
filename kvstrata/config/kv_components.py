"""The pieces a KVPlan (config/kv_plan.py) is made of, no torch: the per-token tensors a pool
kind keeps (`KVComponent`, the mha / mla builders, the component names), the dtypes' element
sizes, and the host memory layouts with the IO backends that can move each. kv_plan.py
re-exports every name, where callers import them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Element sizes of the dtypes a KV component may be stored in (torch names).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "uint8": 1, "int8": 1}

# ---- host memory layouts and the IO backends that can move them ----------------------------
LAYER_FIRST = "layer_first"
PAGE_FIRST = "page_first"
PAGE_FIRST_DIRECT = "page_first_direct"
PAGE_HEAD = "page_head"
HOST_LAYOUTS = (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_HEAD)
IO_BACKENDS = ("direct", "kernel")
# `direct` copies one contiguous block per (page, layer), so only layouts where a page of one
# layer is contiguous qualify; `kernel` gathers rows and handles the others.
IO_BACKEND_LAYOUTS = {
    "kernel": (LAYER_FIRST, PAGE_FIRST, PAGE_HEAD),
    "direct": (LAYER_FIRST, PAGE_FIRST_DIRECT),
}

# ---- pool kinds ------------------------------------------------------------------------------
MHA_K, MHA_V = "k", "v"
MLA_LATENT = "kv_latent"
DSA_INDEX_K = "index_k"
# An EAGLE draft head's feature per token: the target's final hidden state at that position
# (runner/spec/eagle.py), kept beside the head's own K/V in the draft components.
EAGLE_HIDDEN = "eagle_hidden"
POOL_KINDS = {"mha": (MHA_K, MHA_V), "mla": (MLA_LATENT,),
              # swa: hybrid SWA memory; `components` = the full-attention layers' K/V, or
              # none at all for an all-SWA model (`swa_components` hold the windowed ones)
              "swa": (),
              "none": ()}  # none: page bookkeeping only (torch-free fake runners, tests)


def check_host_layout_io(layout: str, io_backend: str) -> None:
    """ValueError unless `io_backend` can move pages of a host pool in `layout`."""
    if layout not in HOST_LAYOUTS:
        raise ValueError(f"unknown host memory layout {layout!r}; expected one of "
                         f"{', '.join(HOST_LAYOUTS)}")
    if io_backend not in IO_BACKEND_LAYOUTS:
        raise ValueError(f"unknown HiCache IO backend {io_backend!r}; expected one of "
                         f"{', '.join(IO_BACKENDS)}")
    if layout not in IO_BACKEND_LAYOUTS[io_backend]:
        raise ValueError(f"--hicache-io-backend {io_backend} cannot move a "
                         f"--hicache-mem-layout {layout} host pool (supported: "
                         f"{', '.join(IO_BACKEND_LAYOUTS[io_backend])})")


@dataclass(frozen=True)
class KVComponent:
    """One per-token tensor kept by `num_layers` layers: `token_shape` elements of `dtype`
    per token and layer."""
    name: str
    num_layers: int
    token_shape: tuple[int, ...]
    dtype: str

    @property
    def bytes_per_token_per_layer(self) -> int:
        return math.prod(self.token_shape) * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Over every layer that keeps this component."""
        return self.bytes_per_token_per_layer * self.num_layers

    def bytes_per_page_per_layer(self, page_size: int) -> int:
        """One contiguous item of a page-major pool: what PD transfer registers per layer."""
        return self.bytes_per_token_per_layer * page_size

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "num_layers": self.num_layers,
                "token_shape": list(self.token_shape), "dtype": self.dtype,
                "bytes_per_token_per_layer": self.bytes_per_token_per_layer}


def page_bytes(components, page_size: int) -> int:
    """Bytes of one page holding `components`: the one formula (KVPlan and the torch-side
    KVGeometry both use it)."""
    return page_size * sum(c.bytes_per_token for c in components)


def mha_components(num_layers: int, num_kv_heads: int, head_dim: int,
                   dtype: str) -> tuple[KVComponent, ...]:
    return tuple(KVComponent(name, num_layers, (num_kv_heads, head_dim), dtype)
                 for name in (MHA_K, MHA_V))


def mla_components(num_layers: int, latent_dim: int, dtype: str,
                   index_head_dim: int | None = None) -> tuple[KVComponent, ...]:
    """MLA latent (kv_lora_rank + qk_rope_head_dim per token), plus the DSA indexer keys."""
    latent = (KVComponent(MLA_LATENT, num_layers, (1, latent_dim), dtype),)
    if index_head_dim is None:
        return latent
    return latent + (KVComponent(DSA_INDEX_K, num_layers, (1, index_head_dim), dtype),)


__all__ = ["DSA_INDEX_K", "DTYPE_BYTES", "EAGLE_HIDDEN", "HOST_LAYOUTS", "IO_BACKENDS",
           "IO_BACKEND_LAYOUTS", "KVComponent", "LAYER_FIRST", "MHA_K", "MHA_V", "MLA_LATENT",
           "PAGE_FIRST", "PAGE_FIRST_DIRECT", "PAGE_HEAD", "POOL_KINDS", "check_host_layout_io",
           "mha_components", "mla_components", "page_bytes"]
