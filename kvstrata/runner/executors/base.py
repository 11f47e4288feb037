"""The runner's half of the seam: one executor per family of op types (protocol Op), behind
one small interface, each living beside the byte movers it drives (HiCache copies and
storage jobs: hicache.py; decode retraction backups: retraction_backup.py; PD
transfers: disagg.py). `ModelRunner.execute` hands each executor the step's ops of
its types, in executor order, runs the forward, then polls them; what they report comes back
to the scheduler as protocol Events, its only way to learn that asynchronous work moved on.
"""
from __future__ import annotations

# An idle step (nothing to compute) waits at most this long on an executor's progress.
IDLE_WAIT_SECONDS = 0.05


class OpExecutor:
    """`op_types`: the protocol op structs this executor takes. Both calls return Events.
    `event_merges`: how N tensor-parallel ranks' events of each type it reports become one
    (runner/executors/tp_merge.py); an event type without a rule passes through from rank 0."""

    op_types: tuple[type, ...] = ()
    event_merges: tuple[type, ...] = ()

    def apply_ops(self, ops: list, idle: bool) -> list:
        """Before the forward: start (or, for sync ops, finish) this step's ops, in order.
        `idle`: the step computes nothing, so an executor may wait (bounded) for progress
        instead of letting the engine loop spin."""
        return []

    def poll_events(self, idle: bool) -> list:
        """After the forward: what changed since the last call."""
        return []

    def close(self) -> None:
        pass


def split_ops(ops: list, executors: list[OpExecutor]) -> list[list]:
    """Each executor's ops (order kept); an op no executor takes is a wiring error."""
    mine: list[list] = [[] for _ in executors]
    for op in ops:
        for i, ex in enumerate(executors):
            if isinstance(op, ex.op_types):
                mine[i].append(op)
                break
        else:
            raise RuntimeError(f"no executor for {type(op).__name__} on this runner "
                               f"(executors: {[type(e).__name__ for e in executors]})")
    return mine


__all__ = ["IDLE_WAIT_SECONDS", "OpExecutor", "split_ops"]
