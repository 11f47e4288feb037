"""One scheduler, N ranks' executors: the events the scheduler sees under tensor parallelism.

Every rank runs the same ops on its own share of the KV (its device pool, host pool, storage
keys, transfer rooms), each at its own pace, so an asynchronous job ends for the scheduler
only when the ranks agree. How each event type is combined is its executor's rule
(runner/executors/tp_merge.py: TransferDone once every rank reported it, StorageProgress the
minimum over ranks, a PD room's state the minimum over ranks as SGLang all-reduces MIN);
this merger applies the rules of every registered executor (runner/executors/registry.py),
so a new executor's events are merged without an edit here. An event type without a rule
passes through from rank 0.
"""
from __future__ import annotations

from kvstrata.runner.executors.registry import event_merges


class EventMerger:
    def __init__(self, size: int):
        self.size = size
        self._rules = [rule(size) for rule in event_merges()]
        self._by_type = {rule.event_type: rule for rule in self._rules}

    def merge(self, per_rank: list[list]) -> list:
        """Rank-ordered event lists of one step -> the scheduler's events: the pass-through
        events first, then each rule's merged events (executor order, arrival order)."""
        out: list = []
        keys: dict[int, list[int]] = {id(rule): [] for rule in self._rules}
        for rank, events in enumerate(per_rank):
            for e in events:
                rule = self._by_type.get(type(e))
                if rule is not None:
                    keys[id(rule)].append(rule.add(rank, e))
                elif rank == 0:
                    out.append(e)
        for rule in self._rules:
            for key in dict.fromkeys(keys[id(rule)]):
                merged = rule.emit(key)
                if merged is not None:
                    out.append(merged)
        return out

    def release(self, rooms) -> None:
        """The scheduler released these PD rooms: no rank reports them any more."""
        rooms = list(rooms)
        for rule in self._rules:
            rule.release(rooms)

    def pending(self) -> int:
        """Jobs some rank reported and some other has not (a state dump's figure)."""
        return sum(rule.pending() for rule in self._rules)


__all__ = ["EventMerger"]
