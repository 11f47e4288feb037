"""Decode attention over the paged fp32 KV pool in one pass (the C extension `_paged_decode`).

Why: a decode step reads every running request's whole context in every layer. Gathering it
into a contiguous copy for SDPA moves each K/V row three times (read, write the copy, SDPA
reads it back); at batch 32 and 512 tokens of context the gather + SDPA measured ~2.5x the
layer's GEMMs (1 thread, SmolLM2 shapes). The kernel reads each row once, straight from the
pool through the request's slots (csrc/paged_decode.c), and scores the query heads that share
a KV head together. fp32 only: other dtypes keep the gather + SDPA path.

One thread by default: the call sits between torch's OpenMP GEMMs, whose worker threads keep
spinning on the other cores for a while after each parallel region; pthreads of our own then
fight them for the same cores (measured: 2 threads made the whole decode step 3x slower than
gather + SDPA on the 2-core box, 1 thread made it faster).
"""
from __future__ import annotations

import torch

from kvstrata.runner.attention import _paged_decode


def supported(kv_dtype: torch.dtype, q_dtype: torch.dtype, device: torch.device) -> bool:
    return kv_dtype == torch.float32 and q_dtype == torch.float32 and device.type == "cpu"


def _addr(name: str, t: torch.Tensor, dtype: torch.dtype) -> int:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor, got {t.dtype} on "
                         f"{t.device}, contiguous={t.is_contiguous()}")
    return t.data_ptr()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor, starts: torch.Tensor, scale: float,
                 out: torch.Tensor | None = None, num_threads: int | None = None) -> torch.Tensor:
    """q [n, Hq, D]; k_cache / v_cache [num_slots, Hkv, D] (one layer of the pool); request b
    attends to the keys at slots[starts[b]:starts[b + 1]] (int64; starts has n + 1 entries).
    Returns out [n, Hq, D]."""
    n, hq, d = q.shape
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3 or k_cache.shape[2] != d:
        raise ValueError(f"k/v caches must both be [slots, Hkv, {d}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if starts.numel() != n + 1:
        raise ValueError(f"starts must have {n + 1} entries, got {starts.numel()}")
    if out is None:
        out = torch.empty_like(q)
    threads = 1 if num_threads is None else num_threads
    pool_bytes = k_cache.numel() * 4
    with torch.profiler.record_function("kvstrata::paged_decode"):  # visible in profiles
        _paged_decode.decode(
            _addr("q", q, torch.float32), q.numel() * 4,
            _addr("k_cache", k_cache, torch.float32), _addr("v_cache", v_cache, torch.float32),
            pool_bytes, _addr("slots", slots, torch.int64), slots.numel(),
            _addr("starts", starts, torch.int64), n, hq, k_cache.shape[1], d, float(scale),
            _addr("out", out, torch.float32), out.numel() * 4, threads)
    return out
