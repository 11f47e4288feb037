"""Runner half of HiCache L2 (and L3): owns the host pool, the IO backend and the transfer
controller, and executes the scheduler's TransferOps (the bookkeeping half is
cache/hiradix_cache.py; only TransferOps and job ids cross between them). With a storage
backend it also owns the storage job runner (transfer/storage_jobs.py) that executes the
"h2s"/"s2h" ops and the step's storage cancels.

All ops go through the controller's single worker thread in list order, so a write-back of
pages and a later load into the same pages cannot overtake each other, and the IO backend's
staging buffer is never used by two threads. If any op of the step is `sync`, the step
waits for the queue to drain before its forward. Storage ops are handed over after that
drain, so a backup queued behind a sync write-back reads the written pages.
"""
from __future__ import annotations

import logging
import time

from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv.host_pool import HostKVPool
from kvstrata.kv.io_backends import make_io_backend
from kvstrata.kv.storage import StorageConfig, StorageNamespace, create_storage_backend
from kvstrata.kv.state_pool import HostStatePool
from kvstrata.kv.storage.base import PREFETCH_CONFIG_KEYS
from kvstrata.protocol import StorageCancel, StorageProgress, TransferDone, TransferOp
from kvstrata.runner.executors.base import IDLE_WAIT_SECONDS, OpExecutor
from kvstrata.runner.executors.tp_merge import AllRanksDone, MinStorageProgress
from kvstrata.transfer.controller import TransferController
from kvstrata.transfer.storage_jobs import StorageJobRunner

_KIND = {"d2h": "write", "h2d": "load"}
_STORAGE_KINDS = ("h2s", "s2h")
logger = logging.getLogger(__name__)
# A page of one layer (K or V) smaller than this makes every copy a scatter of small rows:
# measured 0.27-0.66 of memcpy with 768 B (SmolLM2, page size 1) against 0.8-1.2 with 12 KiB
# (page size 16) for 256-page transfers (docs/benchmarks.md, "HiCache transfer").
SMALL_PAGE_BYTES = 4096


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


class HiCacheExecutor(OpExecutor):
    """HiCache's executor: TransferOps (device <-> host copies, host <-> storage jobs) and
    StorageCancels; reports TransferDone and StorageProgress events."""
    op_types = (TransferOp, StorageCancel)
    event_merges = (AllRanksDone, MinStorageProgress)

    def apply_ops(self, ops: list, idle: bool) -> list:
        transfers = [op for op in ops if isinstance(op, TransferOp)]
        cancels = [op.job_id for op in ops if isinstance(op, StorageCancel)]
        done, failed, progress = self.execute(transfers, idle=idle, cancels=cancels)
        return ([TransferDone(job) for job in done]
                + [TransferDone(job, ok=False) for job in failed] + progress)

    def __init__(self, device_pool, plan: KVPlan, swa_pool=None, state_pool=None):
        """The host pool and IO backend `plan` describes, behind `device_pool`. Hybrid SWA
        memory (`swa_pool`, the window layers' device pool): a second host pool of as many
        pages holds their K/V under the same host page ids (cache/swa_hiradix.py), moved by
        a second IO backend in the same jobs. Recurrent state (`state_pool`): a host state
        store of plan.num_host_state_slots slots; ops with state slot pairs copy to / from
        it at once, in op order (they are sync and carry no pages: cache/state_hiradix.py).
        A model whose pages hold no K/V (Mamba2: `plan.pages_hold_kv` False, `device_pool`
        None) has the host state store only: its page ops report done at once and its L3
        stores state records alone (transfer/storage_jobs.py)."""
        self.state_pool = state_pool
        self.host_states = None
        if state_pool is not None:
            self.host_states = HostStatePool(plan)
        self.swa_host_pool = None
        # A model whose pages hold no K/V (Mamba2, plan.pages_hold_kv): no host page pool,
        # no IO backend, no copy thread; its page ops move nothing and finish at once.
        self.host_pool = self.io = self.controller = None
        swa_io = None
        if swa_pool is not None:
            full = plan.full_pool_plan()
            if full is None:
                raise ValueError("HiCache with hybrid SWA memory needs full-attention layers")
            self.swa_host_pool = HostKVPool.from_plan(plan.swa_pool_plan())
            swa_io = make_io_backend(plan.io_backend, swa_pool.kv, self.swa_host_pool)
            plan_full = full
        else:
            plan_full = plan
        if plan.pages_hold_kv:
            self.host_pool = HostKVPool.from_plan(plan_full)
            self.io = make_io_backend(plan.io_backend, device_pool.kv, self.host_pool)
            advice = page_size_advice(plan_full)
            if advice:
                logger.warning(advice)
            self.controller = TransferController(self.io, swa_io=swa_io)
        elif state_pool is None:
            raise ValueError("HiCache without K/V pages needs a recurrent state pool")
        self._job_of: dict[int, int] = {}  # controller id -> scheduler job id
        self.wait_seconds = 0.0
        self.plan = plan
        self.storage: StorageJobRunner | None = None
        self.skip_backups = False  # an MLA rank > 0 under TP with a shared store

    def enable_storage(self, backend: str, model: str, extra: dict, tp_rank: int = 0,
                       tp_size: int = 1) -> None:
        """HiCache L3: the backend named by --hicache-storage-backend, in the namespace of
        this plan and model (`key_salt` of the extra config isolates tenants). The prefetch
        keys of the extra config belong to the scheduler; the backend gets the others.
        Tensor parallelism: an MHA rank stores its KV heads under its own rank's keys; MLA
        KV is the same on every rank, so with a store shared between processes only rank 0
        writes it and every rank reads it. Hybrid SWA memory: one backend per host pool, in
        the namespace of that pool's component (full / swa; cache/swa_storage.py).
        Recurrent state: one more backend over the host state slots, namespace component
        "state" (cache/state_storage.py). The size limits are shared in proportion to the
        host pools' bytes (with SWA memory: the two pools' page bytes, as their page counts
        are equal; with state: the host state slots' share, which --hicache-mamba-size-gb or
        the device bytes set)."""
        backend_extra = {k: v for k, v in extra.items() if k not in PREFETCH_CONFIG_KEYS}
        salt = str(extra.get("key_salt", ""))

        pools = [p for p in (self.host_pool, self.swa_host_pool, self.host_states) if p]
        total_bytes = sum(p.size_bytes for p in pools)

        def open_store(plan: KVPlan, host_pool, component: str = ""):
            namespace = (StorageNamespace.for_states(plan, model, tp_rank=tp_rank,
                                                     tp_size=tp_size, salt=salt)
                         if component == "state" else
                         StorageNamespace.from_plan(plan, model, tp_rank=tp_rank,
                                                    tp_size=tp_size, salt=salt,
                                                    component=component))
            page_bytes = host_pool.geom.bytes_per_page
            config = StorageConfig(namespace, page_bytes, backend_extra,
                                   share=host_pool.size_bytes / total_bytes)
            logger.info("HiCache storage: %s backend, namespace %s", backend, namespace.name)
            return create_storage_backend(backend, config, host_pool), namespace

        store = swa_store = None  # no page store: pages without K/V (Mamba2) store nothing
        if self.swa_host_pool is not None:
            store, namespace = open_store(self.plan.full_pool_plan(), self.host_pool, "full")
            swa_store = open_store(self.plan.swa_pool_plan(), self.swa_host_pool, "swa")[0]
        elif self.host_pool is not None:
            store, namespace = open_store(self.plan, self.host_pool)
        state_store = (open_store(self.plan, self.host_states, "state")[0]
                       if self.host_states is not None else None)
        self.skip_backups = store is not None and namespace.is_mla and tp_rank > 0 and \
            store.shared_across_processes
        self.storage = StorageJobRunner(store, swa_backend=swa_store, state_backend=state_store)

    def execute(self, ops: list[TransferOp], idle: bool = False, cancels: list[int] = ()
                ) -> tuple[list[int], list[int], list[StorageProgress]]:
        """Queue this step's ops; returns (finished, failed) scheduler job ids of device<->host
        copies so far and the storage jobs' progress. idle: the step computes nothing, so
        wait (bounded) for a copy or progress rather than have the engine loop spin."""
        storage_ops = [op for op in ops if op.kind in _STORAGE_KINDS]
        done_now = []  # state copies (sync, made here) and page ops that move no bytes
        for op in ops:
            if op.kind in _STORAGE_KINDS:
                continue
            if op.state_slots:  # a snapshot to / from the host state store, now
                move = self.host_states.save if op.kind == "d2h" else self.host_states.load
                move(self.state_pool, op.state_slots, op.host_state_slots)
                done_now.append(op.job_id)
            elif self.controller is None:  # pages without K/V: nothing to copy
                done_now.append(op.job_id)
            else:
                cid = self.controller.submit(_KIND[op.kind], op.device_pages, op.host_pages,
                                             op.swa_pages, swa_only=op.swa_only)
                self._job_of[cid] = op.job_id
        if self.controller is None:
            done, failed = [], []
        elif any(op.sync for op in ops):
            start = time.perf_counter()
            done, failed = self.controller.drain()
            self.wait_seconds += time.perf_counter() - start
        elif idle:
            done, failed = self.controller.wait_any(IDLE_WAIT_SECONDS)
        else:
            done, failed = self.controller.poll_finished()
        idle_wait = idle and not (done or failed or done_now)
        progress = self._storage_step(storage_ops, cancels, idle_wait)
        return (done_now + [self._job_of.pop(c) for c in done],
                [self._job_of.pop(c) for c in failed], progress)

    def _storage_step(self, ops: list[TransferOp], cancels: list[int], wait: bool
                      ) -> list[StorageProgress]:
        if self.storage is None:
            if ops or cancels:
                raise RuntimeError("storage ops without --hicache-storage-backend")
            return []
        skipped = []
        for op in ops:
            if op.kind == "h2s" and self.skip_backups:  # rank 0 stores this MLA page
                n = len(op.keys)
                skipped.append(StorageProgress(op.job_id, n, n, True))
                continue
            self.storage.submit(op)
        for job in cancels:  # after submits: a job may be cancelled by the step starting it
            self.storage.cancel(job)
        if skipped:
            return skipped + self.storage.poll()
        if wait:
            return self.storage.wait_any(IDLE_WAIT_SECONDS)
        return self.storage.poll()

    def stats(self) -> dict:
        s = dict(self.controller.stats) if self.controller is not None else {}
        for kind in ("write", "load"):
            secs = s.get(f"{kind}_seconds", 0.0)
            s[f"{kind}_gb_per_s"] = s.get(f"{kind}_bytes", 0.0) / secs / 1e9 if secs else 0.0
        s["host_pool_bytes"] = sum(p.size_bytes for p in (
            self.host_pool, self.swa_host_pool, self.host_states) if p is not None)
        if self.storage is not None:
            pages = self.storage.backend
            s.update({f"storage_{k}": v for k, v in (pages.stats() if pages else {}).items()
                      if isinstance(v, (int, float))})
            # the SWA halves' and the state snapshots' records apart
            for kind, store in (("swa", self.storage.swa_backend),
                                ("state", self.storage.state_backend)):
                if store is not None:
                    s.update({f"storage_{kind}_{k}": v for k, v in store.stats().items()
                              if isinstance(v, (int, float))})
        return s

    def close(self, storage_timeout: float = 2.0) -> None:
        # The scheduler already waited for the backups (EngineCore.finish_storage_backups).
        if self.controller is not None:
            self.controller.drain(timeout=30)
            self.controller.close()
        if self.storage is not None:
            self.storage.drain(storage_timeout)  # logs when the timeout is hit
            self.storage.close()
            self.storage = None
