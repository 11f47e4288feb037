"""L1 KV pool: one tensor holding every layer's K and V for every token slot.

Shape (2, num_layers, (num_pages + 1) * page_size, num_kv_heads, head_dim):
index 0 = K, 1 = V; slot s belongs to page s // page_size. Page 0 (slots 0..P-1) is the
padding sink: padded batch entries read and write there, so it never holds real KV.
Keeping K and V of all layers in a single tensor lets the host pool / IO backends move a
page of every layer with one gather/scatter over the slot dimension.
"""
from __future__ import annotations

import torch


class MHATokenToKVPool:
    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, "
                             f"{page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_slots = (num_pages + 1) * page_size
        # Zero-initialised so the padding sink and never-written slots hold finite values
        # (masked-out keys still go through the matmul; garbage NaNs would poison softmax).
        self.kv = torch.zeros((2, num_layers, self.num_slots, num_kv_heads, head_dim),
                              dtype=dtype, device=self.device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * num_kv_heads * head_dim * 2 * itemsize

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
        self.kv[0, layer].index_copy_(0, slots, k.to(self.dtype))
        self.kv[1, layer].index_copy_(0, slots, v.to(self.dtype))
