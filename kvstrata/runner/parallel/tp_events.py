"""One scheduler, N ranks' executors: the events the scheduler sees under tensor parallelism.

Every rank runs the same TransferOps on its own share of the KV (its device pool, host pool
and storage keys), each at its own pace. The scheduler may reuse a device page once its
write-back ended and may read a page once its load ended -- on every rank -- so a job ends
for the scheduler only when every rank reported it:
  - TransferDone: once all ranks reported the job; ok only if every rank's was ok;
  - StorageProgress: the minimum over ranks (hit pages: -1 while any rank has not asked its
    backend yet; done pages), finished once every rank finished, the first error kept. A
    storage prefetch thus loads what every rank found: the ranks never diverge.
Other events (PD) are not merged: PD under tensor parallelism is refused at start-up.
"""
from __future__ import annotations

from kvstrata.protocol.scheduler_output import StorageProgress, TransferDone


class EventMerger:
    def __init__(self, size: int):
        self.size = size
        self._done: dict[int, dict[int, bool]] = {}
        self._progress: dict[int, dict[int, StorageProgress]] = {}
        self._sent: dict[int, StorageProgress] = {}

    def merge(self, per_rank: list[list]) -> list:
        """Rank-ordered event lists of one step -> the scheduler's events."""
        out: list = []
        done_order: list[int] = []
        progress_order: list[int] = []
        for rank, events in enumerate(per_rank):
            for e in events:
                if isinstance(e, TransferDone):
                    self._done.setdefault(e.job_id, {})[rank] = e.ok
                    done_order.append(e.job_id)
                elif isinstance(e, StorageProgress):
                    self._progress.setdefault(e.job_id, {})[rank] = e
                    progress_order.append(e.job_id)
                elif rank == 0:
                    out.append(e)
        for job in dict.fromkeys(done_order):
            oks = self._done[job]
            if len(oks) == self.size:
                out.append(TransferDone(job, all(oks.values())))
                del self._done[job]
        for job in dict.fromkeys(progress_order):
            merged = self._combined(job)
            if merged is not None and merged != self._sent.get(job):
                out.append(merged)
                self._sent[job] = merged
                if merged.finished:
                    del self._progress[job], self._sent[job]
        return out

    def _combined(self, job: int) -> StorageProgress | None:
        states = self._progress[job]
        if len(states) < self.size:
            return None  # a rank has not reported this job yet
        ranks = list(states.values())
        hits = [s.hit_pages for s in ranks]
        return StorageProgress(
            job, -1 if min(hits) < 0 else min(hits), min(s.done_pages for s in ranks),
            all(s.finished for s in ranks), next((s.error for s in ranks if s.error), ""))

    def pending(self) -> int:
        """Jobs some rank reported and some other has not (a state dump's figure)."""
        return len(self._done) + len(self._progress)


__all__ = ["EventMerger"]
