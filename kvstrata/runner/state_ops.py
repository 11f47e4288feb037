"""The runner's half of recurrent state (SSM / linear-attention models): the state pool from
the plan, and each scheduled request's state fields applied around the forward
(protocol/scheduler_output.py ScheduledRequest.state_*):

  before  state_reset -> the slot zeroed; state_copy_from -> the snapshot copied into the
          slot (a prefix hit, copy-on-write: the snapshot is never written); then the step's
          RecurrentMeta (runner/recurrent/backend.py): which slot each request's recurrent
          layers read and leave their state in, which rows are decode, prefill or verify
  after   a speculative verify's accepted step committed into its slot (the rejected drafts'
          states were never written); then state_snapshot_to <- the slot (the prefix cache
          keeps the state at the end of this step's tokens), or during the forward where
          `state_snapshot_at` falls inside a prefill chunk (the scan splits there)
"""
from __future__ import annotations

from typing import Any

from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv.state_pool import RecurrentStatePool
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.recurrent.backend import RecurrentBackend, RecurrentMeta


def model_state_components(model: Any, ssm_dtype: str = "float32") -> tuple:
    """The model's recurrent layers' per-slot state (conv, ssm) for ModelKVFacts; () for a
    model without recurrent layers."""
    if not getattr(model, "num_recurrent_layers", 0):
        return ()
    return model.state_components(ssm_dtype)


def allocate_state(model: Any, plan: KVPlan, device) -> RecurrentStatePool | None:
    """The state pool the plan sizes, handed to the model's recurrent layers; None for a
    model without recurrent layers (whose plan must then have no state components)."""
    wanted = model_state_components(model)
    if not wanted:
        if plan.state_components:
            raise ValueError(f"the KV plan has state components {plan.state_components} but "
                             f"the model keeps no recurrent state")
        return None
    if not plan.has_state_pool or not plan.state_components:
        raise ValueError(f"{type(model).__name__} has {model.num_recurrent_layers} recurrent "
                         f"layers: its KV plan needs a state pool (num_state_slots > 0 and "
                         f"state_components {[c.to_json() for c in wanted]})")
    got = {c.name: (c.num_layers, c.slot_shape) for c in plan.state_components}
    need = {c.name: (c.num_layers, c.slot_shape) for c in wanted}
    if got != need:
        raise ValueError(f"the KV plan's state components {got} do not match the model's "
                         f"{need} (layers, slot shape)")
    pool = RecurrentStatePool(plan, device)
    # the model's backend class (deterministic inference's fixed_scan one) over the pool
    model.recurrent_backend = type(model.recurrent_backend)(pool)
    return pool


def before_forward(pool: RecurrentStatePool, reqs: list, fb: ForwardBatch) -> None:
    slots = [r.state_slot for r in reqs]
    for r in reqs:
        if not 1 <= r.state_slot < pool.num_slots:
            raise ValueError(f"request {r.rid!r}: state_slot {r.state_slot} is not a slot of "
                             f"the state pool (1..{pool.num_slots - 1})")
        if r.state_reset and r.state_copy_from:
            raise ValueError(f"request {r.rid!r}: state_reset and state_copy_from "
                             f"{r.state_copy_from} both set")
        if r.draft_parents is not None:
            raise ValueError(f"request {r.rid!r}: speculative draft trees are not supported "
                             f"with recurrent state (chains are)")
        if r.state_snapshot_at and not (
                r.state_snapshot_to and not r.num_draft
                and r.start_pos < r.state_snapshot_at <= r.start_pos + len(r.token_ids)):
            raise ValueError(f"request {r.rid!r}: state_snapshot_at {r.state_snapshot_at} is "
                             f"not inside its prefill positions {r.start_pos}.."
                             f"{r.start_pos + len(r.token_ids)} (or no snapshot slot)")
    if len(set(slots)) != len(slots):
        raise ValueError(f"state slots {slots} shared by requests of one batch")
    reset = [r.state_slot for r in reqs if r.state_reset]
    if reset:
        pool.zero_slots(reset)
    copies = [(r.state_copy_from, r.state_slot) for r in reqs if r.state_copy_from]
    if copies:
        pool.copy_slots([s for s, _ in copies], [d for _, d in copies])
    fb.recurrent = RecurrentMeta.build(fb, slots, [r.num_draft > 0 for r in reqs])
    fb.recurrent.snapshots = {i: (r.state_snapshot_at - r.start_pos, r.state_snapshot_to)
                              for i, r in enumerate(reqs) if _interior(r)}


def after_forward(pool: RecurrentStatePool, backend: RecurrentBackend, reqs: list,
                  fb: ForwardBatch, produced: dict) -> None:
    """`produced`: rid -> the tokens this step gave it (a verify entry: its accepted drafts
    and one more, so it accepted len - 1 drafts)."""
    for i, r in enumerate(reqs):
        if r.num_draft:
            backend.commit(fb.recurrent, i, len(produced[r.rid]) - 1)
    snaps = [(r.state_slot, r.state_snapshot_to) for r in reqs
             if r.state_snapshot_to and not _interior(r)]
    if snaps:
        pool.copy_slots([s for s, _ in snaps], [d for _, d in snaps])


def _interior(r) -> bool:
    """A snapshot the forward takes inside the entry's tokens (not at their end)."""
    return bool(r.state_snapshot_at) and r.state_snapshot_at < r.start_pos + len(r.token_ids)
