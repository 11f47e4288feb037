"""How N tensor-parallel ranks' events of one kind become the one event the scheduler sees.

Every rank runs the same ops on its own share of the KV, each at its own pace; an executor
names, beside its op types, the merge rule of each event type it reports
(`OpExecutor.event_merges`), and runner/parallel/tp_events.py applies the rules of every
registered executor (runner/executors/registry.py). A rule keeps per-key state: `add` records
one rank's event and returns its key, `emit` says what the scheduler may see for that key now
(None: not yet, or nothing new).
"""
from __future__ import annotations

from kvstrata.protocol.disagg import KVPoll, PDEvent
from kvstrata.protocol.scheduler_output import StorageProgress, TransferDone


class EventMerge:
    event_type: type = object

    def __init__(self, size: int):
        self.size = size

    def add(self, rank: int, event) -> int:
        raise NotImplementedError

    def emit(self, key: int):
        raise NotImplementedError

    def pending(self) -> int:
        """Keys some rank reported and some other has not (a state dump's figure)."""
        return 0

    def release(self, keys) -> None:
        """The scheduler is done with these keys: no rank reports them any more."""


class AllRanksDone(EventMerge):
    """TransferDone: once every rank reported the job; ok only if every rank's was ok (the
    scheduler may reuse or read a page only when it moved on every rank)."""
    event_type = TransferDone

    def __init__(self, size: int):
        super().__init__(size)
        self._done: dict[int, dict[int, bool]] = {}

    def add(self, rank: int, event: TransferDone) -> int:
        self._done.setdefault(event.job_id, {})[rank] = event.ok
        return event.job_id

    def emit(self, key: int) -> TransferDone | None:
        oks = self._done.get(key, {})
        if len(oks) < self.size:
            return None
        del self._done[key]
        return TransferDone(key, all(oks.values()))

    def pending(self) -> int:
        return len(self._done)


class MinStorageProgress(EventMerge):
    """StorageProgress: the minimum over ranks (hit pages: -1 while any rank has not asked
    its backend yet; done pages; the pages whose SWA half every rank read; the page a
    recurrent state was read at when every rank read it there, else 0), finished once
    every rank finished, the first error kept. A storage prefetch thus loads what every rank
    found: the ranks never diverge."""
    event_type = StorageProgress

    def __init__(self, size: int):
        super().__init__(size)
        self._progress: dict[int, dict[int, StorageProgress]] = {}
        self._sent: dict[int, StorageProgress] = {}

    def add(self, rank: int, event: StorageProgress) -> int:
        self._progress.setdefault(event.job_id, {})[rank] = event
        return event.job_id

    def emit(self, key: int) -> StorageProgress | None:
        states = self._progress.get(key, {})
        if len(states) < self.size:
            return None  # a rank has not reported this job yet
        ranks = list(states.values())
        hits = [s.hit_pages for s in ranks]
        done = min(s.done_pages for s in ranks)
        swa = set.intersection(*(set(s.swa_read) for s in ranks))
        # A recurrent model's state read (each rank its heads' share): resumable at a page
        # only when every rank read its state there; otherwise no state was read.
        state_pages = {s.state_page for s in ranks}
        merged = StorageProgress(
            key, -1 if min(hits) < 0 else min(hits), done,
            all(s.finished for s in ranks), next((s.error for s in ranks if s.error), ""),
            sorted(i for i in swa if i < done),
            state_pages.pop() if len(state_pages) == 1 else 0)
        if merged == self._sent.get(key):
            return None
        self._sent[key] = merged
        if merged.finished:
            del self._progress[key], self._sent[key]
        return merged

    def pending(self) -> int:
        return len(self._progress)


class MinRoomState(EventMerge):
    """PDEvent: a room's state is the minimum over ranks (KVPoll: FAILED 0 < BOOTSTRAPPING <
    WAITING_FOR_INPUT < TRANSFERRING < SUCCESS 4), as SGLang all-reduces MIN over its TP
    group: SUCCESS once every rank's transfer succeeded (rank 0's metadata and page count),
    FAILED as soon as one rank failed (its reason; rank 0's page count if rank 0's room
    has ended too, else 0: a count is per rank, and the server reports rank 0's). Nothing is said of a room before every
    rank reported it once, so the merged state only moves forward; a room is forgotten when
    its `release` op passes."""
    event_type = PDEvent

    def __init__(self, size: int):
        super().__init__(size)
        self._rooms: dict[int, dict[int, PDEvent]] = {}
        self._sent: dict[int, int] = {}  # room -> merged state last emitted

    def add(self, rank: int, event: PDEvent) -> int:
        self._rooms.setdefault(event.room, {})[rank] = event
        return event.room

    def emit(self, key: int) -> PDEvent | None:
        states = self._rooms.get(key, {})
        if len(states) < self.size or self._sent.get(key) in (KVPoll.FAILED, KVPoll.SUCCESS):
            return None
        worst = min(states.values(), key=lambda e: e.state)
        if worst.state == self._sent.get(key):
            return None
        self._sent[key] = worst.state
        if worst.state == KVPoll.SUCCESS:
            return states[0]  # rank 0's: the metadata and the page count
        first = states[0]
        ended = first.state in (KVPoll.FAILED, KVPoll.SUCCESS)
        return PDEvent(key, worst.state, error=worst.error, pages=first.pages if ended else 0,
                       swa_pages=first.swa_pages if ended else 0,
                       state_pages=first.state_pages if ended else 0)

    def pending(self) -> int:
        return len(self._rooms)

    def release(self, keys) -> None:
        for room in keys:
            self._rooms.pop(room, None)
            self._sent.pop(room, None)


__all__ = ["AllRanksDone", "EventMerge", "MinRoomState", "MinStorageProgress"]
