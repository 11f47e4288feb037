"""L2 host KV pool: preallocated (pinned on CUDA/ROCm) RAM holding pages in one of the layouts.

The pool only holds tensors and moves bytes addressed by page ids; which host pages are free
is the cache layer's business (it reuses `cache.page_allocator.PageAllocator`). As on the
device, page 0 is reserved as a padding sink, so usable page ids are 1..num_pages.

Its page count comes from the KV plan (config/kv_sizing.py: `--hicache-size` GB when > 0,
else device-pool tokens x `--hicache-ratio`, whole pages); the allocation is refused up front
when it does not fit in available RAM minus a reserve, because an over-committed pool would be
OOM-killed later, mid-serving.
"""
from __future__ import annotations

import logging
import os

import torch

from kvstrata import platform
from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv import layouts
from kvstrata.kv.layouts import KVGeometry

logger = logging.getLogger(__name__)

GB = 1e9  # decimal GB, as --hicache-size
GiB = 1 << 30
# SGLang keeps 10 GiB free for the rest of the process; on a small box (this project's CPU
# machines have 23 GiB) that would forbid any useful pool, so cap it at a quarter of RAM.
MAX_HOST_MEMORY_RESERVE_BYTES = 10 * GiB


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_ram_bytes() -> int:
    """RAM the kernel could give us without swapping (MemAvailable, not MemFree: page cache
    is reclaimable)."""
    avail = _meminfo_bytes("MemAvailable")
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return avail


def total_ram_bytes() -> int:
    return _meminfo_bytes("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_reserve_bytes() -> int:
    return min(MAX_HOST_MEMORY_RESERVE_BYTES, total_ram_bytes() // 4)


def check_host_memory(requested_bytes: int, flag: str, *, available_bytes: int | None = None,
                      reserve_bytes: int | None = None) -> None:
    """Raise ValueError when `requested_bytes` exceeds available RAM minus the reserve."""
    avail = available_ram_bytes() if available_bytes is None else available_bytes
    reserve = default_reserve_bytes() if reserve_bytes is None else reserve_bytes
    usable = avail - reserve
    if requested_bytes > usable:
        raise ValueError(
            f"Not enough host memory for the hierarchical cache: it needs "
            f"{requested_bytes / GB:.2f} GB but only {max(usable, 0) / GB:.2f} GB may be used "
            f"({avail / GB:.2f} GB available minus a {reserve / GB:.2f} GB reserve). "
            f"Reduce {flag}.")


class HostKVPool:
    """Host copy of the KV pages in `layout`. `kv` is the tensor in its natural shape."""

    def __init__(self, geom: KVGeometry, num_pages: int, layout: str, *,
                 pin_memory: bool | None = None, size_flag: str = "--hicache-ratio",
                 check_memory: bool = True, reserve_bytes: int | None = None):
        layouts.check_layout(layout)
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.geom = geom
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = geom.page_size
        shape = layouts.host_shape(layout, geom, num_pages + 1)
        self.size_bytes = (num_pages + 1) * geom.bytes_per_page
        if check_memory:
            check_host_memory(self.size_bytes, size_flag, reserve_bytes=reserve_bytes)
        if pin_memory is None:
            # Pinned pages let CUDA/ROCm DMA without a bounce buffer; on CPU it means nothing.
            pin_memory = platform.is_cuda_alike()
        logger.info("Allocating %.2f GB host memory for the hierarchical KV cache "
                    "(%d pages of %d tokens, layout %s%s)", self.size_bytes / GB, num_pages,
                    self.page_size, layout, ", pinned" if pin_memory else "")
        self.kv = torch.empty(shape, dtype=geom.dtype, pin_memory=pin_memory)
        # Touch every page now: first-touch page faults cost ~0.28 s/GiB and would otherwise
        # land on the first transfers (and an over-commit would fail mid-serving, not here).
        self.kv.zero_()

    @classmethod
    def from_plan(cls, plan: KVPlan, **kwargs) -> "HostKVPool":
        """The host pool the plan sized (plan.num_host_pages in plan.host_layout)."""
        if not plan.has_host_pool:
            raise ValueError("the KV plan has no host pool (needs --enable-hierarchical-cache)")
        return cls(KVGeometry.from_plan(plan), plan.num_host_pages, plan.host_layout,
                   size_flag=plan.host_size_flag, **kwargs)

    @property
    def num_tokens(self) -> int:
        """Usable token capacity (page 0 excluded)."""
        return self.num_pages * self.page_size

    def device_order(self) -> torch.Tensor:
        """(C, L, num_pages + 1, P, H, D) view of `kv` (see layouts.py)."""
        return layouts.device_order_view(self.layout, self.kv, self.page_size)

    def check_page_ids(self, pages: torch.Tensor) -> None:
        if pages.numel() and (int(pages.min()) < 1 or int(pages.max()) > self.num_pages):
            raise ValueError(f"host page ids must be in 1..{self.num_pages}, got "
                             f"{int(pages.min())}..{int(pages.max())}")

    # ---- flat pages, for the storage tier ------------------------------------------------------
    # A flat page is always ordered (C, L, P, H, D), whatever the host layout: storage keys are
    # layout-independent, so the bytes behind them must be too (a page_first server can then
    # read what a layer_first server stored). For MLA, C = H = 1 and a token's row holds every
    # component (latent, then DSA indexer key): a flat page carries both, in plan order.

    def get_flat_pages(self, pages) -> torch.Tensor:
        """(n, page_numel) copy of host `pages` in flat page order."""
        ids = torch.as_tensor(pages, dtype=torch.long).reshape(-1)
        self.check_page_ids(ids)
        g, order = self.geom, self.device_order()
        out = torch.empty((ids.numel(), g.page_numel), dtype=g.dtype)
        pages_out = out.view(ids.numel(), g.num_sections, g.num_layers, g.page_size,
                             g.num_kv_heads, g.head_dim)
        # One strided copy per page: measured 2x the advanced-index gather + permute.
        for row, page in enumerate(ids.tolist()):
            pages_out[row].copy_(order[:, :, page])
        return out

    def set_flat_pages(self, pages, flat: torch.Tensor) -> None:
        """Write (n, page_numel) flat pages into host `pages`."""
        ids = torch.as_tensor(pages, dtype=torch.long).reshape(-1)
        self.check_page_ids(ids)
        g = self.geom
        if flat.shape != (ids.numel(), g.page_numel) or flat.dtype != g.dtype:
            raise ValueError(f"expected flat pages of shape ({ids.numel()}, {g.page_numel}) and "
                             f"dtype {g.dtype}, got {tuple(flat.shape)} {flat.dtype}")
        src = flat.view(ids.numel(), g.num_sections, g.num_layers, g.page_size, g.num_kv_heads,
                        g.head_dim)
        order = self.device_order()
        # One strided copy per page: measured 1.9x the advanced-index assignment of a permuted
        # source (8.4 vs 4.4 GB/s, 720 KiB pages, 1 thread), which bounded storage reads.
        for row, page in enumerate(ids.tolist()):
            order[:, :, page].copy_(src[row])
