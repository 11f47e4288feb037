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
        self.kv = torch.zeros((2, g.num_layers, self.num_slots, g.num_kv_heads, g.head_dim),
                              dtype=g.dtype, device=self.device)

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
        self.kv[0, layer].index_copy_(0, slots, k.to(self.kv.dtype))
        self.kv[1, layer].index_copy_(0, slots, v.to(self.kv.dtype))


class MLATokenToKVPool:
    """L1 pool of an MLA model (DeepSeek): per layer one latent vector per token slot
    (kv_lora_rank normalised latent + qk_rope_head_dim rotated key, shared by all heads),
    and for a DSA model the indexer's key per slot beside it, addressed by the same slots.

    Shapes: latent (L, num_slots, kv_lora_rank + qk_rope_head_dim); index_k (L, num_slots,
    index_head_dim) or None. Same padding-page rule as the MHA pool."""

    def __init__(self, plan: KVPlan, device: torch.device | str):
        if plan.pool_kind != "mla":
            raise ValueError(f"MLATokenToKVPool needs an mla KV plan, got {plan.pool_kind!r}")
        self.plan = plan
        self.device = torch.device(device)
        self.num_slots = (plan.num_pages + 1) * plan.page_size
        self.tensors: dict[str, torch.Tensor] = {}
        for c in plan.components:
            self.tensors[c.name] = torch.zeros((c.num_layers, self.num_slots, *c.token_shape),
                                               dtype=getattr(torch, c.dtype),
                                               device=self.device)
        self.latent = self.tensors[MLA_LATENT].flatten(2)        # (L, slots, R + r)
        index_k = self.tensors.get(DSA_INDEX_K)
        self.index_k = None if index_k is None else index_k.flatten(2)

    @property
    def size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def set_latent(self, layer: int, slots: torch.Tensor, latent: torch.Tensor,
                   index_k: torch.Tensor | None = None) -> None:
        """Write latent [N, R + r] (and the indexer keys [N, Di]) at `slots` of `layer`."""
        self.latent[layer].index_copy_(0, slots, latent.to(self.latent.dtype))
        if index_k is not None:
            self.index_k[layer].index_copy_(0, slots, index_k.to(self.index_k.dtype))
