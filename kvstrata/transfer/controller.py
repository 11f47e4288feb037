"""Asynchronous device <-> host page transfers for HiCache.

The scheduler decides what to move; this controller moves it off the scheduler thread and
reports back only job ids (ARCHITECTURE.md, "The seam between deciding and doing"):

  job_id = controller.submit("write", device_pages, host_pages)   # device -> host
  job_id = controller.submit("load", device_pages, host_pages)    # host -> device
  finished, failed = controller.poll_finished()                   # since the last poll

Jobs run in submission order on one worker thread. On CPU a job is finished when its copy
returns. On CUDA/ROCm the worker enqueues the copy on a side stream (one for writes, one for
loads, so a load is never queued behind a large write-back) after an event recorded on the
submitter's stream at submit time — the forward that produced the pages — and the job is
finished once the event recorded after the copy has completed.

A job that raises is reported as failed (with its error kept for `error(job_id)`), never
crashes the worker: the cache layer then drops the host copy or recomputes. The pages of a
job must stay locked by the caller until its id comes back in either list.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from kvstrata import platform

logger = logging.getLogger(__name__)

KINDS = ("write", "load")


@dataclass
class TransferJob:
    job_id: int
    kind: str  # "write": device -> host; "load": host -> device
    device_pages: torch.Tensor
    host_pages: torch.Tensor
    ready_event: object = None  # CUDA event on the submitter's stream, GPU only
    # Hybrid SWA memory: (SWA device pages, host pages) moved by the second IO backend in
    # the same job, so the job is done only when both pools' copies are.
    swa: tuple[torch.Tensor, torch.Tensor] | None = None
    swa_only: bool = False  # move the SWA halves only (the full pages stay as they are)
    submitted_at: float = field(default_factory=time.perf_counter)


def _use_streams(device_kv: torch.Tensor) -> bool:
    # The one place that decides whether this controller uses streams and events.
    return platform.is_cuda_alike() and device_kv.is_cuda


class TransferController:
    """Runs `io_backend` transfers on a worker thread; see the module docstring."""

    def __init__(self, io_backend, *, name: str = "kvstrata-hicache-transfer", swa_io=None):
        self.io = io_backend
        self.swa_io = swa_io  # the SWA device pool <-> host SWA pool (hybrid SWA memory)
        self.page_bytes = io_backend.host_pool.geom.bytes_per_page
        self._streams = None
        if _use_streams(io_backend.device_kv):
            self._streams = {kind: torch.cuda.Stream(device=io_backend.device_kv.device)
                             for kind in KINDS}
        self._ids = itertools.count(1)
        self._queue: queue.Queue[TransferJob | None] = queue.Queue()
        self._lock = threading.Lock()
        # Jobs the worker has run: (job_id, done_event or None); events only on GPU.
        self._launched: list[tuple[int, object]] = []
        self._failed: list[int] = []
        self._errors: dict[int, str] = {}
        self._outstanding = 0
        self._idle = threading.Condition(self._lock)
        # Bytes and seconds per kind, for the HiCache metrics (GPU: launch time, not copy time).
        self.stats = {f"{kind}_{what}": 0.0 for kind in KINDS for what in ("bytes", "seconds")}
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=name, daemon=True)
        self._worker.start()

    # ---- scheduler-facing API ----------------------------------------------------------------
    def submit(self, kind: str, device_pages, host_pages, swa_pages=(), swa_only=False) -> int:
        """Queue a transfer of whole pages (device_pages[i] <-> host_pages[i]); returns its id.
        `swa_pages`: the SWA device page of each device page (0: none moves), copied with
        the same host page id by `swa_io`; `swa_only`: only those move (the full pages stay
        as they are). Argument errors (unknown kind, length mismatch) raise here; copy
        errors are reported later as a failed id."""
        if kind not in KINDS:
            raise ValueError(f"transfer kind must be one of {KINDS}, got {kind!r}")
        if self._closed:
            raise RuntimeError("transfer controller is closed")
        dev = torch.as_tensor(device_pages, dtype=torch.long).reshape(-1)
        host = torch.as_tensor(host_pages, dtype=torch.long).reshape(-1)
        if dev.numel() != host.numel():
            raise ValueError(f"{dev.numel()} device pages but {host.numel()} host pages")
        job = TransferJob(next(self._ids), kind, dev, host)
        if len(swa_pages):
            swa = torch.as_tensor(swa_pages, dtype=torch.long).reshape(-1)
            if self.swa_io is None or swa.numel() != dev.numel():
                raise ValueError(f"{swa.numel()} SWA pages for {dev.numel()} device pages "
                                 f"(SWA IO backend: {self.swa_io is not None})")
            keep = swa != 0
            job.swa = (swa[keep], host[keep])
        elif swa_only:
            raise ValueError("a swa_only transfer without SWA pages")
        job.swa_only = swa_only
        if self._streams is not None:
            job.ready_event = torch.cuda.Event()
            job.ready_event.record()  # on the submitter's current stream
        with self._lock:
            self._outstanding += 1
        self._queue.put(job)
        return job.job_id

    def poll_finished(self) -> tuple[list[int], list[int]]:
        """(finished ids, failed ids) since the last call; never blocks on a copy."""
        with self._lock:
            finished, still = [], []
            for job_id, done in self._launched:
                if done is None or done.query():
                    finished.append(job_id)
                else:
                    still.append((job_id, done))
            self._launched = still
            failed, self._failed = self._failed, []
            self._outstanding -= len(finished) + len(failed)
            self._idle.notify_all()
        return finished, failed

    def error(self, job_id: int) -> str | None:
        """The exception text of a failed job (kept for logs and tests)."""
        with self._lock:
            return self._errors.get(job_id)

    def drain(self, timeout: float | None = None) -> tuple[list[int], list[int]]:
        """Block until every submitted job is finished or failed; returns them like
        `poll_finished`. For shutdown, flush and tests — the scheduler loop polls instead."""
        deadline = None if timeout is None else time.monotonic() + timeout
        finished, failed = [], []
        while True:
            f, x = self.poll_finished()
            finished += f
            failed += x
            with self._lock:
                if self._outstanding == 0:
                    return finished, failed
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"{self._outstanding} transfer jobs still running")
                if self._failed or (self._launched and self._streams is None):
                    continue  # reported since our poll: collect before waiting
                # GPU events are polled, not signalled; CPU completions notify the condition.
                wait = 0.001 if self._launched else None
                if deadline is not None:
                    wait = min(wait or 1e9, max(0.0, deadline - time.monotonic()))
                self._idle.wait(wait)

    def wait_any(self, timeout: float) -> tuple[list[int], list[int]]:
        """Block until at least one job is finished or failed, none is outstanding, or
        `timeout` seconds pass; returns them like `poll_finished`. The engine loop calls it
        when a step has nothing to compute but copies in flight, instead of spinning."""
        deadline = time.monotonic() + timeout
        while True:
            finished, failed = self.poll_finished()
            if finished or failed:
                return finished, failed
            with self._lock:
                remaining = deadline - time.monotonic()
                if self._outstanding == 0 or remaining <= 0:
                    return [], []
                if self._failed or (self._launched and self._streams is None):
                    continue  # reported since our poll: collect before waiting
                # GPU events are polled, not signalled; CPU completions notify the condition.
                self._idle.wait(min(0.001, remaining) if self._launched else remaining)

    def close(self) -> None:
        """Stop the worker after the jobs already queued."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._worker.join()

    def __enter__(self) -> "TransferController":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- worker ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            start = time.perf_counter()
            try:
                done = self._execute(job)
            except Exception as exc:  # reported, never raised: the worker must survive
                logger.exception("HiCache %s job %d failed", job.kind, job.job_id)
                with self._lock:
                    self._failed.append(job.job_id)
                    self._errors[job.job_id] = f"{type(exc).__name__}: {exc}"
                    self._idle.notify_all()
                continue
            elapsed = time.perf_counter() - start
            with self._lock:
                self.stats[f"{job.kind}_bytes"] += 0 if job.swa_only else \
                    job.device_pages.numel() * self.page_bytes
                self.stats[f"{job.kind}_seconds"] += elapsed
                self._launched.append((job.job_id, done))
                self._idle.notify_all()

    def _execute(self, job: TransferJob):
        if self._streams is None:
            self._copy(job)
            return None
        stream = self._streams[job.kind]
        with torch.cuda.stream(stream):
            stream.wait_event(job.ready_event)
            self._copy(job)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def _copy(self, job: TransferJob) -> None:
        # (swa_only: device_pages only paired the SWA pages with their host ids)
        if job.kind == "write" and not job.swa_only:
            self.io.write_back(job.device_pages, job.host_pages)
        elif not job.swa_only:
            self.io.load_all(job.host_pages, job.device_pages)
        if job.swa is not None and job.swa[0].numel():
            swa_dev, swa_host = job.swa
            if job.kind == "write":
                self.swa_io.write_back(swa_dev, swa_host)
            else:
                self.swa_io.load_all(swa_host, swa_dev)
