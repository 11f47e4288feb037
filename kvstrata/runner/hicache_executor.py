"""Runner half of HiCache L2: owns the host pool, the IO backend and the transfer
controller, and executes the scheduler's TransferOps (the bookkeeping half is
cache/hiradix_cache.py; only TransferOps and job ids cross between them).

All ops go through the controller's single worker thread in list order, so a write-back of
pages and a later load into the same pages cannot overtake each other, and the IO backend's
staging buffer is never used by two threads. If any op of the step is `sync`, the step
waits for the queue to drain before its forward.
"""
from __future__ import annotations

import time

from kvstrata.kv.host_pool import HostKVPool
from kvstrata.kv.io_backends import make_io_backend
from kvstrata.protocol import TransferOp
from kvstrata.transfer.controller import TransferController

_KIND = {"d2h": "write", "h2d": "load"}


class HiCacheExecutor:
    def __init__(self, device_pool, layout: str, io_backend: str,
                 hicache_ratio: float | None, hicache_size: float):
        self.host_pool = HostKVPool.from_device_pool(device_pool, layout,
                                                     hicache_ratio=hicache_ratio,
                                                     hicache_size=hicache_size)
        self.io = make_io_backend(io_backend, device_pool.kv, self.host_pool)
        self.controller = TransferController(self.io)
        self._job_of: dict[int, int] = {}  # controller id -> scheduler job id
        self.wait_seconds = 0.0

    @property
    def num_host_pages(self) -> int:
        return self.host_pool.num_pages

    def execute(self, ops: list[TransferOp]) -> tuple[list[int], list[int]]:
        """Queue this step's ops; returns (finished, failed) scheduler job ids so far."""
        for op in ops:
            cid = self.controller.submit(_KIND[op.kind], op.device_pages, op.host_pages)
            self._job_of[cid] = op.job_id
        if any(op.sync for op in ops):
            start = time.perf_counter()
            done, failed = self.controller.drain()
            self.wait_seconds += time.perf_counter() - start
        else:
            done, failed = self.controller.poll_finished()
        return ([self._job_of.pop(c) for c in done], [self._job_of.pop(c) for c in failed])

    def stats(self) -> dict:
        s = dict(self.controller.stats)
        for kind in ("write", "load"):
            secs = s.get(f"{kind}_seconds", 0.0)
            s[f"{kind}_gb_per_s"] = s.get(f"{kind}_bytes", 0.0) / secs / 1e9 if secs else 0.0
        s["host_pool_bytes"] = self.host_pool.size_bytes
        return s

    def close(self) -> None:
        self.controller.drain(timeout=30)
        self.controller.close()
