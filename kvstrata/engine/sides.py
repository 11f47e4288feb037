"""Which sides a scheduler gets, from its config (no torch). The one place that knows the
side classes: the scheduler only iterates `sched.sides`. To add one: a SchedulerSide
subclass (engine/side.py), its ops/events in protocol/, its executor in the runner, and a
line here (docs/architecture.md, "How to add a side")."""
from __future__ import annotations

from kvstrata.engine.disagg_decode import DecodeDisagg
from kvstrata.engine.disagg_prefill import PrefillDisagg

_PD_SIDES = {"prefill": PrefillDisagg, "decode": DecodeDisagg}


def build_sides(sched) -> None:
    """Register the sides `sched.config` asks for, in call order, on `sched.sides`; the PD
    side (prefill or decode, with decode retraction inside) is also `sched.pd`."""
    pd_side = _PD_SIDES.get(sched.config.disaggregation_mode)
    if pd_side is not None:
        sched.pd = pd_side(sched)
        sched.sides.append(sched.pd)


__all__ = ["build_sides"]
