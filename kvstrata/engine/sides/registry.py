"""Which sides a scheduler gets, from its config (no torch). The one place that knows the
side classes: the scheduler only iterates `sched.sides`. To add one: a SchedulerSide
subclass (engine/sides/base.py), its ops/events in protocol/, its executor in the runner, and a
line here (docs/architecture.md, "How to add a side")."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.engine.sides.disagg_common import DisaggSide
from kvstrata.engine.sides.disagg_decode import DecodeDisagg
from kvstrata.engine.sides.disagg_prefill import PrefillDisagg
from kvstrata.engine.sides.priority import PrioritySide
from kvstrata.engine.sides.speculative import SpeculativeSide

if TYPE_CHECKING:  # annotations only: no import circle
    from kvstrata.engine.scheduler.core import Scheduler

_PD_SIDES = {"prefill": PrefillDisagg, "decode": DecodeDisagg}
# Every side class (build_sides below picks from these): metrics read their counters here.
SIDE_CLASSES = (SpeculativeSide, PrioritySide, PrefillDisagg, DecodeDisagg)


def side_counters() -> dict[str, str]:
    """Every side's running-total load keys -> help (for the Prometheus counters)."""
    return {key: doc for cls in SIDE_CLASSES for key, doc in cls.counters.items()}


def build_sides(sched: Scheduler) -> None:
    """Register the sides `sched.config` asks for, in call order, on `sched.sides`.
    Speculation comes first: it only watches arrivals (`take` returns False); priority
    next (it refuses arrivals to a full queue), and a PD side takes every request it sees. A prefill server never decodes: no drafts."""
    cfg = sched.config
    if cfg.speculative_algorithm is not None and cfg.disaggregation_mode != "prefill":
        sched.sides.append(SpeculativeSide(sched))
    if cfg.enable_priority_scheduling or cfg.max_queued_requests is not None:
        sched.sides.append(PrioritySide(sched))  # before PD: a refused newcomer is never taken
    side = _PD_SIDES.get(cfg.disaggregation_mode)
    if side is not None:
        sched.sides.append(side(sched))


def spec_side(sched: Scheduler) -> SpeculativeSide | None:
    return next((s for s in sched.sides if isinstance(s, SpeculativeSide)), None)


def pd_side(sched: Scheduler) -> DisaggSide | None:
    """The PD side (prefill or decode, with decode retraction inside), None when co-located:
    for the engine factory (metadata slots) and introspection."""
    return next((s for s in sched.sides if isinstance(s, DisaggSide)), None)


__all__ = ["SIDE_CLASSES", "build_sides", "pd_side", "side_counters", "spec_side"]
