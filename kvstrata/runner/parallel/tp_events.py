"""One scheduler, N ranks' executors: the events the scheduler sees under tensor parallelism.

Every rank runs the same TransferOps on its own share of the KV (its device pool, host pool
and storage keys), each at its own pace. The scheduler may reuse a device page once its
write-back ended and may read a page once its load ended -- on every rank -- so a job ends
for the scheduler only when every rank reported it:
  - TransferDone: once all ranks reported the job; ok only if every rank's was ok;
  - StorageProgress: the minimum over ranks (hit pages: -1 while any rank has not asked its
    backend yet; done pages), finished once every rank finished, the first error kept. A
    storage prefetch thus loads what every rank found: the ranks never diverge;
  - PDEvent: a room's state is the minimum over ranks (KVPoll: FAILED 0 < BOOTSTRAPPING <
    WAITING_FOR_INPUT < TRANSFERRING < SUCCESS 4), as SGLang all-reduces MIN over its TP
    group: SUCCESS once every rank's transfer succeeded (rank 0's metadata and page count),
    FAILED as soon as one rank failed (its reason). Nothing is said of a room before every
    rank reported it once, so the merged state only moves forward; a room is forgotten when
    its `release` op passes (`release`).
"""
from __future__ import annotations

from kvstrata.protocol.disagg import KVPoll, PDEvent
from kvstrata.protocol.scheduler_output import StorageProgress, TransferDone


class EventMerger:
    def __init__(self, size: int):
        self.size = size
        self._done: dict[int, dict[int, bool]] = {}
        self._progress: dict[int, dict[int, StorageProgress]] = {}
        self._sent: dict[int, StorageProgress] = {}
        self._rooms: dict[int, dict[int, PDEvent]] = {}
        self._room_sent: dict[int, int] = {}  # room -> merged state last emitted

    def merge(self, per_rank: list[list]) -> list:
        """Rank-ordered event lists of one step -> the scheduler's events."""
        out: list = []
        done_order: list[int] = []
        progress_order: list[int] = []
        room_order: list[int] = []
        for rank, events in enumerate(per_rank):
            for e in events:
                if isinstance(e, TransferDone):
                    self._done.setdefault(e.job_id, {})[rank] = e.ok
                    done_order.append(e.job_id)
                elif isinstance(e, StorageProgress):
                    self._progress.setdefault(e.job_id, {})[rank] = e
                    progress_order.append(e.job_id)
                elif isinstance(e, PDEvent):
                    self._rooms.setdefault(e.room, {})[rank] = e
                    room_order.append(e.room)
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
        for room in dict.fromkeys(room_order):
            merged = self._room_state(room)
            if merged is not None:
                out.append(merged)
        return out

    def _room_state(self, room: int) -> PDEvent | None:
        states = self._rooms[room]
        if len(states) < self.size or self._room_sent.get(room) in (KVPoll.FAILED,
                                                                     KVPoll.SUCCESS):
            return None
        worst = min(states.values(), key=lambda e: e.state)
        if worst.state == self._room_sent.get(room):
            return None
        self._room_sent[room] = worst.state
        if worst.state == KVPoll.SUCCESS:
            return states[0]  # rank 0's: the metadata and the page count
        return PDEvent(room, worst.state, error=worst.error)

    def release(self, rooms) -> None:
        """The scheduler released these rooms: no rank reports them any more."""
        for room in rooms:
            self._rooms.pop(room, None)
            self._room_sent.pop(room, None)

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
        return len(self._done) + len(self._progress) + len(self._rooms)


__all__ = ["EventMerger"]
