"""A reusable staging buffer of flat pages, filled from the host pool with one copy per page.

`HostKVPool.get_flat_pages` returns a new tensor through two copies (an advanced-index gather,
then a reshape of the permuted result) into freshly allocated memory, whose first-touch page
faults cost as much as the copies: 0.8 GB/s for 720 KiB pages on this machine, below what a
segment file takes (docs/benchmarks.md). Backends that write pages out (file, mooncake) gather
instead into a buffer they keep, in the same flat order (C, L, P, H, D) that
`get_flat_pages`/`set_flat_pages` define, so any layout still reads what any other wrote (the
cross-layout round-trip tests hold both to it). Reading back uses `set_flat_pages`, which
already copies once without allocating.
"""
from __future__ import annotations

import torch


class FlatPageStaging:
    """`capacity` flat pages of `page_bytes` as a (capacity, page_bytes) uint8 tensor;
    `gather(host_pool, host_pages)` fills the first rows. Not thread-safe: one per thread."""

    def __init__(self, page_bytes: int, capacity: int):
        if capacity < 1:
            raise ValueError(f"staging capacity must be >= 1 page, got {capacity}")
        self.capacity = capacity
        self.buffer = torch.zeros((capacity, page_bytes), dtype=torch.uint8)  # touched now

    def gather(self, host_pool, host_pages: list[int]) -> torch.Tensor:
        """Rows [0, n) of the buffer hold `host_pool`'s pages `host_pages` in flat order."""
        n, g = len(host_pages), host_pool.geom
        if n > self.capacity:
            raise ValueError(f"{n} pages do not fit a {self.capacity}-page staging buffer")
        if g.bytes_per_page != self.buffer.shape[1]:
            raise ValueError(f"host pages of {g.bytes_per_page} bytes in a staging buffer of "
                             f"{self.buffer.shape[1]}-byte pages")
        host_pool.check_page_ids(torch.as_tensor(host_pages, dtype=torch.long))
        order = host_pool.device_order()  # (C, L, pages, P, H, D) view of the host tensor
        rows = self.buffer[:n]
        dst = rows.view(g.dtype).view(n, g.num_sections, g.num_layers, g.page_size,
                                      g.num_kv_heads, g.head_dim)
        for row, page in enumerate(host_pages):
            dst[row].copy_(order[:, :, page])
        return rows

    def chunks(self, items: list):
        """`items` in runs of at most `capacity`."""
        for start in range(0, len(items), self.capacity):
            yield items[start:start + self.capacity]
