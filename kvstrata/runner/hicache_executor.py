"""Runner half of HiCache L2: owns the host pool, the IO backend and the transfer
controller, and executes the scheduler's TransferOps (the bookkeeping half is
cache/hiradix_cache.py; only TransferOps and job ids cross between them).

All ops go through the controller's single worker thread in list order, so a write-back of
pages and a later load into the same pages cannot overtake each other, and the IO backend's
staging buffer is never used by two threads. If any op of the step is `sync`, the step
waits for the queue to drain before its forward.
"""
from __future__ import annotations

import logging
import time

from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv.host_pool import HostKVPool
from kvstrata.kv.io_backends import make_io_backend
from kvstrata.protocol import TransferOp
from kvstrata.transfer.controller import TransferController

_KIND = {"d2h": "write", "h2d": "load"}
logger = logging.getLogger(__name__)
# A page of one layer (K or V) smaller than this makes every copy a scatter of small rows:
# measured 0.27-0.66 of memcpy with 768 B (SmolLM2, page size 1) against 0.8-1.2 with 12 KiB
# (page size 16) for 256-page transfers (docs/benchmarks.md, "HiCache transfer").
SMALL_PAGE_BYTES = 4096
# Longest wait of an idle step for a copy: the loop then returns to read new requests.
IDLE_WAIT_SECONDS = 0.05


def page_size_advice(plan: KVPlan) -> str | None:
    """A start-up warning when pages are too small for fast host copies, else None."""
    token_bytes = plan.section_bytes_per_token_per_layer
    page_bytes = token_bytes * plan.page_size  # one contiguous run per (page, layer)
    if page_bytes >= SMALL_PAGE_BYTES:
        return None
    suggest = -(-SMALL_PAGE_BYTES // token_bytes)  # tokens for 4 KiB
    suggest = 1 << (suggest - 1).bit_length()
    return (f"HiCache with --page-size {plan.page_size}: a page of one layer is {page_bytes} "
            f"bytes, so host<->device copies move small scattered rows (about half of memcpy "
            f"speed); --page-size {max(16, suggest)} or more keeps them near memcpy")


class HiCacheExecutor:
    def __init__(self, device_pool, plan: KVPlan):
        """The host pool and IO backend `plan` describes, behind `device_pool`."""
        self.host_pool = HostKVPool.from_plan(plan)
        self.io = make_io_backend(plan.io_backend, device_pool.kv, self.host_pool)
        advice = page_size_advice(plan)
        if advice:
            logger.warning(advice)
        self.controller = TransferController(self.io)
        self._job_of: dict[int, int] = {}  # controller id -> scheduler job id
        self.wait_seconds = 0.0

    def execute(self, ops: list[TransferOp], idle: bool = False) -> tuple[list[int], list[int]]:
        """Queue this step's ops; returns (finished, failed) scheduler job ids so far.
        idle: the step computes nothing, so wait (bounded) for a copy to finish rather than
        return at once and have the engine loop spin on an empty step."""
        for op in ops:
            cid = self.controller.submit(_KIND[op.kind], op.device_pages, op.host_pages)
            self._job_of[cid] = op.job_id
        if any(op.sync for op in ops):
            start = time.perf_counter()
            done, failed = self.controller.drain()
            self.wait_seconds += time.perf_counter() - start
        elif idle:
            done, failed = self.controller.wait_any(IDLE_WAIT_SECONDS)
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
