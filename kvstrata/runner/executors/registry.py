"""The runner's executors, in the order a step applies their ops: the one list the model
runner, tensor parallelism's event merger and the docs read (docs/architecture.md, "How to
add a side": a new feature is one side + its op/event types + one line here).

Order: retraction backups first (a backed-up request's device pages may be handed to another
request -- a PD receive, this forward -- in the same step), then tier moves (loads this
forward reads, write-backs of pages it may overwrite), then PD ops.
"""
from __future__ import annotations

from kvstrata.runner.executors.base import OpExecutor
from kvstrata.runner.executors.disagg import DisaggExecutor
from kvstrata.runner.executors.hicache import HiCacheExecutor
from kvstrata.runner.executors.retraction_backup import RetractionBackupExecutor

# name (the ModelRunner attribute that holds it) -> class
EXECUTORS: dict[str, type[OpExecutor]] = {
    "backup": RetractionBackupExecutor,
    "hicache": HiCacheExecutor,
    "disagg": DisaggExecutor,
}


def event_merges() -> list:
    """Every registered executor's TP merge rule classes, in executor order."""
    return [m for cls in EXECUTORS.values() for m in cls.event_merges]


__all__ = ["EXECUTORS", "event_merges"]
