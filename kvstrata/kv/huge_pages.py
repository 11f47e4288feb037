"""Transparent huge pages for the CPU KV pool.

Why: decode attention reads each request's K and V rows through its page table, and a
request's pages lie anywhere in a pool of GBs. With 4 KiB pages nearly every new KV page
is a TLB miss (SmolLM2 at --max-total-tokens 65536: a 1.5 GB bf16 pool, 393k pages). The
paged decode kernel at batch 32 x 190 tokens, 30 layers, pages scattered over such a pool:
9.1-12.2 ms with 4 KiB pages, 7.9-8.7 ms with 2 MiB pages (the same pages in a small pool:
6.2 ms; AMD EPYC, 2 threads, 2026-12-03). Most Linux boxes run THP in `madvise` mode, where
only regions that ask get huge pages, so the pool asks (madvise MADV_HUGEPAGE) before it is
first touched. Nothing changes where THP is off or the call fails; KVSTRATA_CPU_HUGE_PAGES=0
skips it (ablation).
"""
from __future__ import annotations

import ctypes
import sys

import torch

from kvstrata import envs

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


def empty_cpu_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory asked for huge pages before it was first written
    (zeroing then faults it in as 2 MiB pages where the kernel allows)."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t.zero_()


def advise_huge_pages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB-aligned part of t's memory; True when the
    kernel accepted it. Only for large CPU tensors on Linux, unless ablated."""
    nbytes = t.numel() * t.element_size()
    if (t.device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < 2 * HUGE_PAGE
            or not envs.KVSTRATA_CPU_HUGE_PAGES.get()):
        return False
    start = (t.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    length = (t.data_ptr() + nbytes - start) & ~(HUGE_PAGE - 1)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False
