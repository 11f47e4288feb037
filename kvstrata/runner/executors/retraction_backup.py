"""Runner half of decode retraction with KV backup: applies the scheduler's BackupOps
(protocol/disagg.py), synchronously, before anything else of the step runs.

A decode server cannot recompute a prompt it never ran, so a retracted request's KV is
copied out of the device pool and copied back, into newly allocated pages, when the request
resumes. Two backends (SGLang's `--disaggregation-decode-retraction-backup`):

  cpu_tensor  CPU tensors this executor owns, one per request id (a real copy: the device
              pages go back to the allocator as soon as the op is applied).
  host_pool   the host pool's pages, allocated and freed by the scheduler; the copy goes
              through the same IO backend HiCache uses (kv/io_backends.py).

A backup holds whole pages of every layer, K and V (only the first `num_tokens` tokens
matter; the rest of the last page is copied along). On CPU a cpu_tensor backup is one native
page gather (kv/rowcopy.py) into a (2 * layers, pages, page row) tensor and a restore one
native scatter: measured ~15 GB/s on a 2k-token SmolLM2 request against 6-9 GB/s for
index_select / index_copy_. A fresh backup tensor's first touch costs as much again (page
faults); see benchmarks/bench_retraction.py. With the device pool on a GPU the gather and
scatter are torch index ops on the device and one copy across the bus.

With recurrent state (SSM / linear-attention models) a backup also keeps the request's state
slot (`BackupOp.state_slot`): a CPU copy of the slot with either backend (SGLang's
get_cpu_copy takes the KV and the mamba slot together; its host-pool path carries no state,
which is why the auto rule picks cpu_tensor for these models), written into the request's
new slot at restore. A model without K/V (Mamba2) keeps only that: `device_pool` None.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvstrata.kv import rowcopy
from kvstrata.kv.host_pool import HostKVPool
from kvstrata.kv.io_backends import make_io_backend
from kvstrata.kv.layouts import as_words
from kvstrata.protocol.disagg import BackupOp
from kvstrata.runner.executors.base import OpExecutor

BACKENDS = ("cpu_tensor", "host_pool")
KINDS = ("backup", "restore", "discard")


@dataclass
class _CpuBackup:
    words: torch.Tensor  # (2 * L, num_pages, page row) in wide words, on the CPU
    num_tokens: int

    @property
    def num_pages(self) -> int:
        return self.words.shape[1]

    @property
    def nbytes(self) -> int:
        return self.words.numel() * self.words.element_size()


class RetractionBackupExecutor(OpExecutor):
    """Applies BackupOps against `device_pool` (an MHATokenToKVPool). `host_pool` and `io`
    (a KVIOBackend over the same device tensor) are given when the plan has a retraction
    host pool; without them only cpu_tensor ops are accepted."""

    op_types = (BackupOp,)

    def apply_ops(self, ops: list, idle: bool) -> list:
        self.apply(ops)  # synchronous: done before anything else of the step
        return []

    def __init__(self, device_pool, host_pool=None, io=None, state_pool=None):
        if (host_pool is None) != (io is None):
            raise ValueError("a host_pool backup needs both the host pool and its IO backend")
        if device_pool is None and (state_pool is None or host_pool is not None):
            raise ValueError("a backup without a KV pool keeps state slots only (cpu_tensor)")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.io = io
        self.state_pool = state_pool
        self._states: dict[str, dict] = {}  # rid -> the CPU copy of its state slot
        self._cpu: dict[str, _CpuBackup] = {}
        # hybrid SWA memory: a cpu_tensor executor over the SWA pool (with_swa_pool)
        self.swa: RetractionBackupExecutor | None = None
        self._host: dict[str, tuple[int, ...]] = {}  # rid -> host pages holding its backup
        self._stats: dict[str, float] = {}
        if device_pool is not None:
            self._kv_geometry(device_pool)

    def _kv_geometry(self, device_pool) -> None:
        kv = device_pool.kv
        P = device_pool.plan.page_size
        self.page_size = P
        self.num_pages = kv.shape[2] // P - 1
        self.bytes_per_page = device_pool.geom.bytes_per_page
        words = as_words(kv)
        two_l, slots = kv.shape[0] * kv.shape[1], kv.shape[2]
        row = P * words[0, 0, 0].numel()  # one page of one layer (K or V), in words
        self._words = words
        self._pages = words.view(two_l, slots // P, row)  # (2L, pages + 1, row)
        self._row_bytes = row * words.element_size()
        self._native = kv.device.type == "cpu"
        # Byte offsets for the native copy: the (kv, layer) rows of a page in the pool.
        self._pool_rows = torch.arange(two_l, dtype=torch.long) * self._pages.stride(0) * \
            words.element_size()

    # ------------------------------------------------------------------ public
    def apply(self, ops: list[BackupOp]) -> None:
        """Apply ops in order; each copy has finished when this returns."""
        for op in ops:
            if op.backend not in BACKENDS:
                raise ValueError(f"BackupOp for {op.rid!r}: unknown backend {op.backend!r}")
            if op.kind not in KINDS:
                raise ValueError(f"BackupOp for {op.rid!r}: unknown kind {op.kind!r}")
            if op.kind == "discard":
                self._discard(op)
                if self.swa is not None:
                    self.swa.apply([op])  # its own discard
                continue
            if op.state_slot:
                self._apply_state(op)
            if self.device_pool is None:
                continue  # no K/V: the pages are addresses only
            if op.swa_pages:
                self._apply_swa(op)
            pages = self._check_pages(op)
            start = time.perf_counter()
            if op.backend == "cpu_tensor":
                (self._cpu_backup if op.kind == "backup" else self._cpu_restore)(op, pages)
            else:
                (self._host_backup if op.kind == "backup" else self._host_restore)(op, pages)
            self._count(op.backend, op.kind, pages.numel() * self.bytes_per_page,
                        time.perf_counter() - start)

    def _apply_swa(self, op: BackupOp) -> None:
        """Hybrid SWA memory: the live window's SWA pages go to (come from) the same backend
        over the SWA pool, beside the full pages' backup: cpu_tensor, or host_pool's SWA half
        under the host page ids of their full pages (the last len(swa_pages) of the op's,
        as the window is the last pages' SWA: protocol/disagg.py BackupOp)."""
        if self.swa is None:
            raise ValueError(f"BackupOp {op.kind} for {op.rid!r} names SWA pages, but this "
                             f"runner has no SWA pool")
        host = list(op.host_pages[len(op.host_pages) - len(op.swa_pages):]) \
            if op.backend == "host_pool" else []
        self.swa.apply([BackupOp(kind=op.kind, rid=op.rid, backend=op.backend,
                                 device_pages=list(op.swa_pages), host_pages=host)])

    def _apply_state(self, op: BackupOp) -> None:
        """Recurrent state: copy the request's state slot out (backup) or into its new slot
        (restore), on the CPU whatever the KV backend."""
        if self.state_pool is None:
            raise ValueError(f"BackupOp {op.kind} for {op.rid!r} names state slot "
                             f"{op.state_slot}, but this runner has no state pool")
        start = time.perf_counter()
        if op.kind == "backup":
            if op.rid in self._states:
                raise ValueError(f"request {op.rid!r} already has a state backup")
            copy = self._states[op.rid] = self.state_pool.cpu_copy([op.state_slot])
        else:
            copy = self._states.pop(op.rid, None)
            if copy is None:
                raise ValueError(f"restore of {op.rid!r}: no state backup held")
            self.state_pool.restore([op.state_slot], copy)
        self._count("state", op.kind, sum(t.numel() * t.element_size() for t in copy.values()),
                    time.perf_counter() - start)

    def has_backup(self, rid: str) -> bool:
        return rid in self._cpu or rid in self._host or rid in self._states

    @property
    def num_backups(self) -> int:
        return len(set(self._cpu) | set(self._host) | set(self._states))

    def stats(self) -> dict:
        """Counters per backend and direction (`cpu_tensor_backup_bytes`,
        `host_pool_restore_seconds`, `..._count`), totals over both backends
        (`backup_bytes`, `restore_seconds`, ...), `discard_count`, and what is held now."""
        s = {f"{b}_{k}_{m}": 0.0 for b in BACKENDS for k in ("backup", "restore")
             for m in ("bytes", "seconds", "count")}
        s.update(self._stats)
        for k in ("backup", "restore"):
            for m in ("bytes", "seconds", "count"):
                s[f"{k}_{m}"] = sum(s[f"{b}_{k}_{m}"] for b in BACKENDS)
            secs = s[f"{k}_seconds"]
            s[f"{k}_gb_per_s"] = s[f"{k}_bytes"] / secs / 1e9 if secs else 0.0
        s.setdefault("discard_count", 0.0)
        s["held_backups"] = self.num_backups
        s["held_cpu_tensor_bytes"] = sum(b.nbytes for b in self._cpu.values())
        return s

    def close(self) -> None:
        """Drop every backup (the runner is shutting down)."""
        self._cpu.clear()
        self._host.clear()
        self._states.clear()

    # ------------------------------------------------------------------ cpu_tensor
    def _cpu_backup(self, op: BackupOp, pages: torch.Tensor) -> None:
        if op.rid in self._cpu or op.rid in self._host:
            raise ValueError(f"request {op.rid!r} already has a KV backup")
        n = pages.numel()
        if self._native:
            buf = torch.empty((self._pages.shape[0], n, self._pages.shape[2]),
                              dtype=self._words.dtype)
            rowcopy.copy_pages(buf, self._words, self._buf_offsets(n),
                               self._page_offsets(pages), self._buf_rows(n), self._pool_rows,
                               self._row_bytes)
        else:
            buf = torch.index_select(self._pages, 1, pages.to(self._pages.device)).cpu()
        self._cpu[op.rid] = _CpuBackup(buf, op.num_tokens)

    def _cpu_restore(self, op: BackupOp, pages: torch.Tensor) -> None:
        backup = self._cpu.get(op.rid)
        if backup is None:
            raise ValueError(f"restore of {op.rid!r}: no cpu_tensor backup held")
        if pages.numel() != backup.num_pages:
            raise ValueError(f"restore of {op.rid!r}: {pages.numel()} device pages for a "
                             f"backup of {backup.num_pages}")
        n = pages.numel()
        if self._native:
            rowcopy.copy_pages(self._words, backup.words, self._page_offsets(pages),
                               self._buf_offsets(n), self._pool_rows, self._buf_rows(n),
                               self._row_bytes)
        else:
            self._pages.index_copy_(1, pages.to(self._pages.device),
                                    backup.words.to(self._pages.device))
        del self._cpu[op.rid]

    def _page_offsets(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages * (self._pages.stride(1) * self._words.element_size())).contiguous()

    def _buf_offsets(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.long) * self._row_bytes

    def _buf_rows(self, n: int) -> torch.Tensor:
        return torch.arange(self._pages.shape[0], dtype=torch.long) * (n * self._row_bytes)

    # ------------------------------------------------------------------ host_pool
    def _host_backup(self, op: BackupOp, pages: torch.Tensor) -> None:
        self._need_host(op)
        if op.rid in self._cpu or op.rid in self._host:
            raise ValueError(f"request {op.rid!r} already has a KV backup")
        self.io.write_back(pages, op.host_pages)
        self._host[op.rid] = tuple(op.host_pages)

    def _host_restore(self, op: BackupOp, pages: torch.Tensor) -> None:
        self._need_host(op)
        held = self._host.get(op.rid)
        if held is None:
            raise ValueError(f"restore of {op.rid!r}: no host_pool backup held")
        if tuple(op.host_pages) != held:
            raise ValueError(f"restore of {op.rid!r}: host pages {op.host_pages} differ from "
                             f"the backup's {list(held)}")
        self.io.load_all(op.host_pages, pages)
        del self._host[op.rid]

    def _need_host(self, op: BackupOp) -> None:
        if self.io is None:
            raise ValueError(f"BackupOp {op.kind} for {op.rid!r} uses the host pool, but this "
                             f"runner has no retraction host pool (KVPlan.host_pool_use)")
        if len(op.host_pages) != len(op.device_pages):
            raise ValueError(f"BackupOp {op.kind} for {op.rid!r}: {len(op.device_pages)} "
                             f"device pages but {len(op.host_pages)} host pages")

    # ------------------------------------------------------------------ common
    def _discard(self, op: BackupOp) -> None:
        # Idempotent: an unknown rid (already restored, discarded, or never backed up) is fine.
        dropped = self._cpu.pop(op.rid, None) is not None
        dropped |= self._host.pop(op.rid, None) is not None
        dropped |= self._states.pop(op.rid, None) is not None
        self._stats["discard_count"] = self._stats.get("discard_count", 0.0) + dropped

    def _check_pages(self, op: BackupOp) -> torch.Tensor:
        pages = torch.as_tensor(op.device_pages, dtype=torch.long).reshape(-1)
        if pages.numel() and (int(pages.min()) < 1 or int(pages.max()) > self.num_pages):
            raise ValueError(f"BackupOp {op.kind} for {op.rid!r}: device page ids must be in "
                             f"1..{self.num_pages}, got {op.device_pages}")
        if op.num_tokens > pages.numel() * self.page_size:
            raise ValueError(f"BackupOp {op.kind} for {op.rid!r}: {op.num_tokens} tokens do "
                             f"not fit in {pages.numel()} pages of {self.page_size}")
        if op.kind == "restore" and pages.numel() != torch.unique(pages).numel():
            raise ValueError(f"restore of {op.rid!r}: duplicate device pages {op.device_pages}")
        return pages

    def _count(self, backend: str, kind: str, nbytes: int, seconds: float) -> None:
        for metric, value in (("bytes", nbytes), ("seconds", seconds), ("count", 1)):
            key = f"{backend}_{kind}_{metric}"
            self._stats[key] = self._stats.get(key, 0.0) + value


def with_swa_pool(executor: RetractionBackupExecutor, swa_pool, swa_host_pool=None,
                  io_backend: str = "kernel") -> RetractionBackupExecutor:
    """Give the executor the SWA pool's (None: no SWA pool), for BackupOp.swa_pages: a
    cpu_tensor executor over it, and with a host pool also the host pool's SWA half
    (`swa_host_pool`: as many pages as the full one, the same ids), moved by an
    `io_backend` of its own (the plan's)."""
    if swa_pool is None:
        return executor
    if executor.io is None or swa_host_pool is None:
        executor.swa = RetractionBackupExecutor(swa_pool)
        return executor
    executor.swa = RetractionBackupExecutor(swa_pool, swa_host_pool, make_io_backend(
        io_backend, swa_pool.kv, swa_host_pool))
    return executor


def retraction_pool_backup(plan, device_pool, swa_pool=None) -> RetractionBackupExecutor:
    """The executor of a plan whose host pool holds retraction backups only (host_pool_use
    "retraction", a decode server without HiCache): its host pool, and with hybrid SWA
    memory the full pool's host pool plus an SWA half of as many pages (with_swa_pool)."""
    host = HostKVPool.from_plan(plan.full_pool_plan())
    executor = RetractionBackupExecutor(device_pool, host, make_io_backend(
        plan.io_backend, device_pool.kv, host))
    swa_host = HostKVPool.from_plan(plan.swa_pool_plan()) if swa_pool is not None else None
    return with_swa_pool(executor, swa_pool, swa_host, plan.io_backend)


def on_demand_backup(device_pool, hicache=None, state_pool=None) -> RetractionBackupExecutor:
    """The executor built at the first BackupOp of a plan without a retraction host pool:
    cpu_tensor backups (with the state pool's slots: recurrent state), and with HiCache on a
    decode server also host_pool backups into HiCache's host pool (one pool, shared:
    cache/kv_manager.py), through an IO backend of their own (HiCache's transfer thread
    keeps its own staging)."""
    if hicache is None:
        return RetractionBackupExecutor(device_pool, state_pool=state_pool)
    host = hicache.host_pool
    return RetractionBackupExecutor(device_pool, host, make_io_backend(
        hicache.plan.io_backend, device_pool.kv, host))

