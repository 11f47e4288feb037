"""Host <-> storage page jobs for HiCache L3 (the byte-moving half of cache/storage_tier.py).

One thread runs backups ("h2s": host pages -> storage), another prefetches ("s2h": ask how
many leading keys exist, then read them into host pages), so a long backup never delays a
prefetch a queued request waits for. Jobs move in batches of `batch_pages`; each job reports
StorageProgress as it goes and ends with exactly one `finished` entry. A backend exception
ends the job with `error` set: the worker never dies. A prefetch can be cancelled: it stops
between batches, and `cancel` returns only once its final progress is queued, so the caller
reports it in the same step.

Hybrid SWA memory (`swa_backend`, over the host SWA pool; cache/swa_storage.py): an op's
`swa_keys` name the SWA half of each host page. A backup stores it beside the full record. A
prefetch, after each batch of full records, asks which SWA records exist for the pages read
so far and reads just one window of them: the last `swa_window_pages` pages before the
furthest end whose window is wholly stored (`stored_window_end`) -- what a match ending there
reads. So every progress report names that usable end in `swa_read` (pages below
`done_pages`); a corrupt SWA record leaves its page full-only (the match is cut before it).

Recurrent state (`state_backend`, over the host state slots; cache/state_storage.py): an
"h2s" with `state_keys` and no pages stores host state slots. An "s2h" with `state_keys` (one
per page: the snapshot after it) asks which exist among the leading hit pages, reads the
furthest one into its host state slot (a corrupt record: the next furthest), and cuts
`hit_pages` there (`state_page`) before reading any page: a page past the last stored
state could only be resumed by recomputing from there.

Pages without K/V (a model whose layers are all recurrent, Mamba2): no page backend
(`backend` None). A page backup stores nothing and is done at once; a prefetch must name
state keys, and its leading "stored" pages are all of them -- a state key chains over the
whole prefix, so the furthest stored state alone says how far the prefix is known -- cut at
that state, with no page to read.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from kvstrata.protocol import StorageProgress, TransferOp

logger = logging.getLogger(__name__)

STORAGE_BATCH_PAGES = 128  # SGLang's storage_batch_size


@dataclass
class _Job:
    op: TransferOp
    hit: int = -1
    done: int = 0
    swa_read: list[int] = field(default_factory=list)  # s2h: pages whose SWA half was read
    swa_stored: list[bool] = field(default_factory=list)  # s2h: SWA record exists, per page
    started: bool = False
    ended: bool = False
    cancelled: bool = False
    state_page: int = 0  # s2h with state_keys: where the state read is (0: none)


class StorageJobRunner:
    def __init__(self, backend, batch_pages: int = STORAGE_BATCH_PAGES, swa_backend=None,
                 state_backend=None):
        self.backend = backend
        self.swa_backend = swa_backend
        self.state_backend = state_backend
        self.batch_pages = batch_pages
        self._lock = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._progress: dict[int, StorageProgress] = {}  # latest per job, since last poll
        self._queues = {"h2s": queue.Queue(), "s2h": queue.Queue()}
        self._threads = [threading.Thread(target=self._run, args=(kind,), daemon=True,
                                          name=f"kvstrata-storage-{kind}")
                         for kind in self._queues]
        for t in self._threads:
            t.start()

    # ---- runner-facing API --------------------------------------------------------------
    def submit(self, op: TransferOp) -> None:
        if op.kind not in self._queues or len(op.keys) != len(op.host_pages):
            raise ValueError(f"not a storage job: kind {op.kind!r}, {len(op.keys)} keys, "
                             f"{len(op.host_pages)} host pages")
        if self.backend is None and op.kind == "s2h" and not op.state_keys:
            raise ValueError("a prefetch of pages without K/V needs state keys: no page "
                             "record says how far a prefix is stored")
        if op.swa_keys and (self.swa_backend is None or len(op.swa_keys) != len(op.keys)):
            raise ValueError(f"{len(op.swa_keys)} SWA keys for {len(op.keys)} pages"
                             + ("" if self.swa_backend else " without an SWA storage backend"))
        if op.state_keys:
            if self.state_backend is None:
                raise ValueError("state storage keys without a state storage backend")
            ok = (len(op.state_keys) == len(op.host_state_slots) and not op.keys
                  if op.kind == "h2s" else
                  len(op.state_keys) == len(op.keys) and len(op.host_state_slots) == 1)
            if not ok:
                raise ValueError(f"{len(op.state_keys)} state keys and "
                                 f"{len(op.host_state_slots)} host state slots for "
                                 f"{len(op.keys)} pages in an {op.kind!r} job")
        with self._lock:
            self._jobs[op.job_id] = _Job(op)
        self._queues[op.kind].put(op.job_id)

    def cancel(self, job_id: int) -> None:
        """Stop a prefetch after the batch it is reading; returns once its final progress is
        queued (at once if it had not started). Unknown (already ended) ids are ignored."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            job.cancelled = True
            if not job.started:
                self._end(job, "")
            while not job.ended:
                self._lock.wait()

    def poll(self) -> list[StorageProgress]:
        with self._lock:
            out = list(self._progress.values())
            self._progress.clear()
        return out

    def wait_any(self, timeout: float) -> list[StorageProgress]:
        """Block until some progress is reported, nothing is running, or `timeout` passes."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self._progress and self._jobs:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._lock.wait(remaining)
        return self.poll()

    def busy(self) -> bool:
        with self._lock:
            return bool(self._jobs)

    def drain(self, timeout: float) -> bool:
        """Wait for every job to end (prefetches are cancelled first): True when all did."""
        with self._lock:
            prefetches = [j for j, job in self._jobs.items() if job.op.kind == "s2h"]
        for job_id in prefetches:
            self.cancel(job_id)
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._jobs:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning("HiCache storage: %d jobs still running after %.1f s",
                                   len(self._jobs), timeout)
                    return False
                self._lock.wait(remaining)
        return True

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)
        for extra in (self.backend, self.swa_backend, self.state_backend):
            if extra is not None:
                extra.close()

    # ---- workers ------------------------------------------------------------------------
    def _report(self, job: _Job, finished: bool = False, error: str = "") -> None:
        """Under the lock."""
        self._progress[job.op.job_id] = StorageProgress(job.op.job_id, job.hit, job.done,
                                                        finished, error,
                                                        list(job.swa_read), job.state_page)
        self._lock.notify_all()

    def _end(self, job: _Job, error: str) -> None:
        """Under the lock: the final progress; the job is forgotten."""
        job.ended = True
        self._jobs.pop(job.op.job_id, None)
        self._report(job, finished=True, error=error)

    def _run(self, kind: str) -> None:
        while True:
            job_id = self._queues[kind].get()
            if job_id is None:
                return
            with self._lock:
                job = self._jobs.get(job_id)
                if job is None or job.ended:
                    continue  # cancelled before it started
                job.started = True
            try:
                error = self._backup(job) if kind == "h2s" else self._prefetch(job)
            except Exception as exc:  # reported, never raised: the worker must survive
                logger.exception("HiCache storage %s job %d failed", kind, job_id)
                error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._end(job, error)

    def _batches(self, n: int):
        for start in range(0, n, self.batch_pages):
            yield start, min(start + self.batch_pages, n)

    def _backup(self, job: _Job) -> str:
        op = job.op
        if op.state_keys:
            return self._backup_states(job)
        job.hit = len(op.keys)
        if self.backend is None:  # pages without K/V: nothing to store
            with self._lock:
                job.done = job.hit
                self._report(job)
            return ""
        for start, end in self._batches(len(op.keys)):
            ok = self.backend.batch_set(op.keys[start:end], op.host_pages[start:end])
            stored = _leading(ok)
            if op.swa_keys and stored:
                # A page whose SWA record failed is still stored (full-only): a restore then
                # cuts its match back where the window is missing (the store counts it).
                self.swa_backend.batch_set(op.swa_keys[start:start + stored],
                                           op.host_pages[start:start + stored])
            with self._lock:
                job.done += stored
                self._report(job)
            if stored < end - start:
                return f"{end - start - stored} pages of a batch were not stored"
        return ""

    def _backup_states(self, job: _Job) -> str:
        op = job.op
        job.hit = len(op.state_keys)
        stored = _leading(self.state_backend.batch_set(op.state_keys, op.host_state_slots))
        with self._lock:
            job.done = stored
            self._report(job)
        return "" if stored == job.hit else f"{job.hit - stored} states were not stored"

    def _read_state(self, op: TransferOp, hit: int) -> int:
        """The furthest page end among the first `hit` whose state record is read into the
        op's host state slot, 0 if none."""
        stored = self.state_backend.exist_flags(op.state_keys[:hit])
        for i in range(hit - 1, -1, -1):
            if stored[i] and self.state_backend.batch_get([op.state_keys[i]],
                                                          op.host_state_slots[:1])[0]:
                return i + 1
        return 0

    def _prefetch(self, job: _Job) -> str:
        op = job.op
        # pages without K/V: every page "exists"; the furthest stored state decides
        hit = len(op.keys) if self.backend is None else self.backend.batch_exists(op.keys)
        if op.state_keys and hit:
            hit = self._read_state(op, hit)
        with self._lock:
            job.hit = hit
            job.state_page = hit if op.state_keys else 0
            if self.backend is None:
                job.done = hit  # no page to read
            self._report(job)
        if self.backend is None:
            return ""
        for start, end in self._batches(hit):
            with self._lock:
                if job.cancelled:
                    return ""
            got = _leading(self.backend.batch_get(op.keys[start:end], op.host_pages[start:end]))
            swa = self._read_swa(job, start + got) if op.swa_keys and got else []
            with self._lock:
                job.done += got
                job.swa_read += swa
                self._report(job)
            if got < end - start:
                return ""  # a record failed its checks: a miss, the rest is recomputed
        return ""


    def _read_swa(self, job: _Job, end: int) -> list[int]:
        """After the full records of pages [0, end): read the window before the furthest
        end whose SWA records are all stored (those not read yet); their indices."""
        op = job.op
        keys, pages = op.swa_keys, op.host_pages
        known = len(job.swa_stored)
        job.swa_stored += self.swa_backend.exist_flags(keys[known:end])
        stop = stored_window_end(job.swa_stored, op.swa_window_pages)
        done = set(job.swa_read)
        todo = [i for i in range(max(stop - op.swa_window_pages, 0), stop) if i not in done]
        if not todo:
            return []
        ok = self.swa_backend.batch_get([keys[i] for i in todo], [pages[i] for i in todo])
        return [i for i, got in zip(todo, ok) if got]


def stored_window_end(stored: list[bool], window_pages: int) -> int:
    """The largest end e <= len(stored) whose window -- the pages [e - window_pages, e), cut
    at 0 (the rest of it is the tree's business) -- all have `stored` set; 0 if none."""
    end = len(stored)
    while end > 0:
        missing = next((j for j in range(end - 1, max(end - window_pages, 0) - 1, -1)
                        if not stored[j]), None)
        if missing is None:
            return end
        end = missing  # every end in (missing, end] has `missing` in its window
    return 0


def _leading(flags: list[bool]) -> int:
    n = 0
    while n < len(flags) and flags[n]:
        n += 1
    return n
