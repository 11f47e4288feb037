"""Host-pool memory layouts and the index arithmetic shared by the IO backends.

Every layout stores the same pages; only the order of the dimensions differs. C sections
(MHA: 2, index 0 K and 1 V; MLA: 1, each token's latent and DSA indexer key side by side),
L layers, H kv heads (MLA: 1), D head dim (MLA: every component's elements per token),
P page size, N pages (page 0 included: it is the padding sink, as on the device). The
tables below write C as 2.

  layout              host tensor shape        contiguous run per (page, layer)
  layer_first         (2, L, N*P, H, D)        P*H*D   (same order as the device pool)
  page_first          (2, N*P, L, H, D)        H*D     (one token of one layer)
  page_first_direct   (2, N, L, P, H, D)       P*H*D
  page_head           (2, N, H, P, L, D)       D       (one head of one token of one layer)

The device pool is (2, L, N*P, H, D) (layer_first order). To move pages between any two of
these without a layout-specific kernel, every tensor is also seen in *device order*,
(2, L, N, P, H, D), as a permuted view; the IO backends then work on that one shape.

Copies run on "wide word" views (int64 when D*itemsize allows): torch's index ops are much
slower on narrow dtypes (index_copy_ on uint8 measured 1.3 GB/s vs 11-14 on int64 here), and
moving words keeps bf16/fp16 payloads bit-exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Layout names are defined once, with the KV plan (the resolver and the CLI read them too).
from kvstrata.config.kv_plan import (HOST_LAYOUTS as LAYOUTS, LAYER_FIRST, MHA_K, PAGE_FIRST,
                                     PAGE_FIRST_DIRECT, PAGE_HEAD, KVComponent, KVPlan,
                                     mha_components, page_bytes)

# Permutation taking each layout's page-split view to device order (kv, L, page, P, H, D).
# Page-split views: layer_first (2, L, N, P, H, D); page_first (2, N, P, L, H, D);
# page_first_direct (2, N, L, P, H, D); page_head (2, N, H, P, L, D).
_TO_DEVICE_ORDER = {
    LAYER_FIRST: (0, 1, 2, 3, 4, 5),
    PAGE_FIRST: (0, 3, 1, 2, 4, 5),
    PAGE_FIRST_DIRECT: (0, 2, 1, 3, 4, 5),
    PAGE_HEAD: (0, 4, 1, 3, 2, 5),
}


@dataclass(frozen=True)
class KVGeometry:
    """The torch-side view of a KVPlan: the dims and the torch dtype the device and host pool
    tensors are built with, (num_sections, L, slots, H, D). Sizes and validation belong to
    the plan; this is the one description every mover (host pool, IO backends, retraction
    backup, PD page buffers, storage flat pages) reads."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    num_sections: int = 2  # MHA K and V; 1 for MLA (all components of a token in one row)

    @classmethod
    def from_plan(cls, plan: KVPlan) -> "KVGeometry":
        if plan.pool_kind == "mla":
            return cls._mla(plan)
        k = plan.component(MHA_K)  # KeyError for a pool kind without K/V
        heads, head_dim = k.token_shape
        return cls(k.num_layers, heads, head_dim, plan.page_size, getattr(torch, k.dtype))

    @classmethod
    def _mla(cls, plan: KVPlan) -> "KVGeometry":
        """One section, one "head" whose row is every component of the token in plan order
        (kv_latent, then index_k): the indexer pages travel with the latent pages."""
        comps = plan.components
        if len({c.dtype for c in comps}) != 1 or len({c.num_layers for c in comps}) != 1:
            raise ValueError(f"an mla pool keeps its components in one tensor: they need one "
                             f"dtype and layer count, got {[c.to_json() for c in comps]}")
        width = sum(math.prod(c.token_shape) for c in comps)
        return cls(comps[0].num_layers, 1, width, plan.page_size, getattr(torch, comps[0].dtype),
                   num_sections=1)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_numel(self) -> int:
        """Elements in one flat page (C, L, P, H, D)."""
        return self.num_sections * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim

    @property
    def components(self) -> tuple[KVComponent, ...]:
        """The plan's components this geometry stores (MLA: one row per token holding
        every component, so one component of that width)."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.num_sections == 2:
            return mha_components(self.num_layers, self.num_kv_heads, self.head_dim, dtype)
        return (KVComponent("row", self.num_layers, (self.num_kv_heads, self.head_dim), dtype),)

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one flat page tensor: the plan's formula (config/kv_plan.page_bytes)."""
        return page_bytes(self.components, self.page_size)


def check_layout(layout: str) -> None:
    if layout not in _TO_DEVICE_ORDER:
        raise ValueError(f"unknown host memory layout {layout!r}; expected one of "
                         f"{', '.join(LAYOUTS)}")


def host_shape(layout: str, geom: KVGeometry, num_pages_total: int) -> tuple[int, ...]:
    """Natural shape of the host tensor holding `num_pages_total` pages (page 0 included)."""
    check_layout(layout)
    L, H, D, P = geom.num_layers, geom.num_kv_heads, geom.head_dim, geom.page_size
    N, C = num_pages_total, geom.num_sections
    return {
        LAYER_FIRST: (C, L, N * P, H, D),
        PAGE_FIRST: (C, N * P, L, H, D),
        PAGE_FIRST_DIRECT: (C, N, L, P, H, D),
        PAGE_HEAD: (C, N, H, P, L, D),
    }[layout]


def _page_split(layout: str, t: torch.Tensor, page_size: int) -> torch.Tensor:
    """Split the token axis of layer_first/page_first tensors into (pages, P)."""
    if layout == LAYER_FIRST:
        two, L, T, H, D = t.shape
        return t.view(two, L, T // page_size, page_size, H, D)
    if layout == PAGE_FIRST:
        two, T, L, H, D = t.shape
        return t.view(two, T // page_size, page_size, L, H, D)
    return t  # page_first_direct and page_head already have a page axis


def device_order_view(layout: str, t: torch.Tensor, page_size: int) -> torch.Tensor:
    """View of a tensor in `layout` as (C, L, N, P, H, D) without copying."""
    check_layout(layout)
    return _page_split(layout, t, page_size).permute(*_TO_DEVICE_ORDER[layout])


def wide_word_dtype(last_dim_bytes: int) -> torch.dtype:
    """Widest integer dtype that tiles the innermost (head_dim) axis exactly."""
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if last_dim_bytes % size == 0:
            return dt
    return torch.uint8


def as_words(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret the innermost axis of a tensor with a unit-stride last axis as wide words."""
    return t.view(wide_word_dtype(t.shape[-1] * t.element_size()))


def row_unit(*views: torch.Tensor) -> tuple[int, int]:
    """The largest trailing block of (P, H, D) that is contiguous in every given device-order
    view: one gathered/scattered row moves such a block. Returns (elements, dims covered)."""
    unit, covered = 1, 0
    for dim in (5, 4, 3):  # D, then H, then P
        if all(v.stride(dim) == unit for v in views):
            unit *= views[0].shape[dim]
            covered += 1
        else:
            break
    return unit, covered
