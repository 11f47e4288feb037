"""L1 KV pool: one tensor holding every layer's K and V for every token slot.

Shape (2, num_layers, (num_pages + 1) * page_size, num_kv_heads, head_dim):
index 0 = K, 1 = V; slot s belongs to page s // page_size. Page 0 (slots 0..P-1) is the
padding sink: padded batch entries read and write there, so it never holds real KV.
Keeping K and V of all layers in a single tensor lets the host pool / IO backends move a
page of every layer with one gather/scatter over the slot dimension.
"""
from __future__ import annotations

import torch

from kvstrata.config.kv_plan import DSA_INDEX_K, MLA_LATENT, KVPlan
from kvstrata.kv import _rowcopy
from kvstrata.kv.huge_pages import empty_cpu_pool
from kvstrata.kv.layouts import KVGeometry


class MHATokenToKVPool:
    def __init__(self, plan: KVPlan, device: torch.device | str):
        """Allocates what `plan` (an mha plan) describes: its pages plus the padding page."""
        self.plan = plan
        self.geom = KVGeometry.from_plan(plan)
        self.device = torch.device(device)
        self.num_slots = (plan.num_pages + 1) * plan.page_size
        g = self.geom
        # Zero-initialised so the padding sink and never-written slots hold finite values
        # (masked-out keys still go through the matmul; garbage NaNs would poison softmax).
        shape = (2, g.num_layers, self.num_slots, g.num_kv_heads, g.head_dim)
        # On CPU in 2 MiB pages where the kernel allows (kv/huge_pages.py: TLB misses).
        self.kv = (empty_cpu_pool(shape, g.dtype) if self.device.type == "cpu"
                   else torch.zeros(shape, dtype=g.dtype, device=self.device))
        # set_kv's fast path (called once a layer a step: its checks and views once cost ~34
        # us a call, ~1 ms of a 26 ms batch-1 SmolLM2 step): what it compares, computed once.
        self._scatter_cpu = self.kv.device.type == "cpu" and self.kv.is_contiguous()
        self._token_shape = self.kv.shape[3:]
        self._row_bytes = g.num_kv_heads * g.head_dim * self.kv.element_size()
        self._layer_bytes = self.num_slots * self._row_bytes

    @property
    def size_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def k(self, layer: int) -> torch.Tensor:
        return self.kv[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.kv[1, layer]

    def kv_layer(self, layer: int) -> torch.Tensor:
        """(2, num_slots, H, D) view: gathering K and V together costs one index op."""
        return self.kv[:, layer]

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v of shape [N, H, D] at `slots` ([N] int64) of `layer`."""
        args = self.scatter_args(layer, slots, k, v)
        if args is not None:
            _rowcopy.scatter_kv(*args)
            return
        self.kv[0, layer].index_copy_(0, slots, k.to(self.kv.dtype))
        self.kv[1, layer].index_copy_(0, slots, v.to(self.kv.dtype))

    def scatter_args(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple | None:
        """The arguments of the one C call (kv/csrc/rowcopy.c scatter_kv) that writes k, v at
        `slots` of `layer`, or None where it does not apply (set_kv then copies with torch).
        Layer l's arguments are layer 0's with the first two (the K and V bases) moved by
        l * layer_bytes (runner/models/decode_plan.py relies on it)."""
        if not (self._scatter_cpu and 0 <= layer < self.geom.num_layers
                and slots.dtype is torch.int64 and slots.is_cpu and slots.is_contiguous()
                and self._scatter_fits(slots, k) and self._scatter_fits(slots, v)):
            return None
        base = self.kv.data_ptr()  # [2][L][slots][H][D], contiguous
        size = k.element_size()
        return (base + layer * self._layer_bytes,
                base + (self.geom.num_layers + layer) * self._layer_bytes,
                self.num_slots, self._row_bytes, slots.data_ptr(), slots.numel(),
                k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K (or V) in `kv`."""
        return self._layer_bytes

    def _scatter_fits(self, slots: torch.Tensor, x: torch.Tensor) -> bool:
        """One C call can write x's rows (kv/csrc/rowcopy.c scatter_kv; the pool and the
        slots are set_kv's to check): x of the pool's dtype and [N, H, D] shape on the CPU,
        each token's H x D values contiguous."""
        return (x.is_cpu and x.dtype is self.kv.dtype and x.dim() == 3
                and x.shape[1:] == self._token_shape and x.shape[0] == slots.numel()
                and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                and x.stride(0) >= x.shape[1] * x.shape[2])

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K and V of slots `src` into slots `dst` (sources read first)."""
        self.kv[:, :, dst] = self.kv[:, :, src]


class MLATokenToKVPool:
    """L1 pool of an MLA model (DeepSeek): per layer one latent vector per token slot
    (kv_lora_rank normalised latent + qk_rope_head_dim rotated key, shared by all heads),
    and for a DSA model the indexer's key beside it, in the same row of the same slot.

    One tensor `kv` of shape (1, L, num_slots, 1, latent + index) -- the KVGeometry of an mla
    plan (kv/layouts.py) -- so the host pool, IO backends, retraction backup and PD page
    buffers move MLA pages with the code they use for MHA, indexer keys included.
    `latent` (L, slots, latent) and `index_k` (L, slots, index) are views of it."""

    def __init__(self, plan: KVPlan, device: torch.device | str):
        if plan.pool_kind != "mla":
            raise ValueError(f"MLATokenToKVPool needs an mla KV plan, got {plan.pool_kind!r}")
        self.plan = plan
        self.geom = g = KVGeometry.from_plan(plan)
        self.device = torch.device(device)
        self.num_slots = (plan.num_pages + 1) * plan.page_size
        shape = (1, g.num_layers, self.num_slots, 1, g.head_dim)
        self.kv = (empty_cpu_pool(shape, g.dtype) if self.device.type == "cpu"
                   else torch.zeros(shape, dtype=g.dtype, device=self.device))
        rows = self.kv[0, :, :, 0]                                   # (L, slots, width)
        latent_dim = plan.component(MLA_LATENT).token_shape[-1]
        self.latent = rows[..., :latent_dim]
        has_index = any(c.name == DSA_INDEX_K for c in plan.components)
        self.index_k = rows[..., latent_dim:] if has_index else None

    @property
    def size_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def set_latent(self, layer: int, slots: torch.Tensor, latent: torch.Tensor,
                   index_k: torch.Tensor | None = None) -> None:
        """Write latent [N, R + r] (and the indexer keys [N, Di]) at `slots` of `layer`."""
        self.latent[layer].index_copy_(0, slots, latent.to(self.kv.dtype))
        if index_k is not None:
            self.index_k[layer].index_copy_(0, slots, index_k.to(self.kv.dtype))


def page_buffers_of(pool: MHATokenToKVPool | MLATokenToKVPool | None,
                    num_pages: int = 0) -> list[torch.Tensor]:
    """The pool's KV as the one page buffer the transfer backends register: uint8
    [sections * num_layers, num_pages + 1, page_size * heads * dim * itemsize], sharing the
    pool's memory (page p of section (s, layer) is contiguous: kv[s, layer, slots of p]).
    The shape is the pool's KVGeometry: MHA 2 sections (K, V); MLA 1 section whose rows hold
    the latent and the DSA indexer key, so the indexer pages travel with the KV pages."""
    if pool is None:  # an all-SWA model's full pool: page ids with no bytes (num_pages of them)
        return [torch.empty((1, num_pages + 1, 0), dtype=torch.uint8)]
    kv = pool.kv
    sections = kv.shape[0] * kv.shape[1]
    return [kv.view(torch.uint8).view(sections, pool.plan.num_pages + 1, -1)]
