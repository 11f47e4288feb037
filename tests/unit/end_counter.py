"""A scheduler side that counts, per request, the arrivals it sees and the on_finish calls:
the fuzzers install it first on every scheduler and check at the drain that each request the
scheduler was given ended exactly once through its one end path (engine/sides/base.py's
contract), whatever way it ended."""
from __future__ import annotations

from collections import Counter

from kvstrata.engine.sides.base import SchedulerSide


class EndCounter(SchedulerSide):
    def __init__(self):
        self.arrived: list[str] = []
        self.ended: Counter = Counter()

    def take(self, req) -> bool:
        self.arrived.append(req.rid)
        return False  # only watches; the other sides and the queues take the request

    def on_finish(self, req) -> None:
        self.ended[req.rid] += 1

    def check_drained(self, name: str = "") -> None:
        twice = {rid: n for rid, n in self.ended.items() if n != 1}
        assert not twice, f"{name}: on_finish ran more than once: {twice}"
        never = set(self.arrived) - set(self.ended)
        assert not never, f"{name}: on_finish never ran for {sorted(never)}"
        stray = set(self.ended) - set(self.arrived)
        assert not stray, f"{name}: on_finish for requests never given: {sorted(stray)}"


def install(engine) -> EndCounter:
    """Put a counter first on `engine`'s scheduler (it sees every arrival before a side
    takes the request)."""
    counter = EndCounter()
    engine.scheduler.sides.insert(0, counter)
    return counter
