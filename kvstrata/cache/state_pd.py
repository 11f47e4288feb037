"""Recurrent state across PD disaggregation, the page side (no torch).

SGLang (disaggregation/prefill.py send_kv_chunk, StateType.MAMBA): the prefill streams the
full-attention layers' pages as for any model and, on the last chunk only, the request's one
state slot -- the conv window and SSM state of every recurrent layer after the whole prompt;
the decode allocates a state slot for the request (HybridMambaDecodeReqToTokenPool) and the
slot's bytes land in it. No snapshot and no speculative intermediate state crosses.

On the wire the state slot is a "page" of a third region (transfer/disagg/regions.py STATE:
the state pool's tensors registered as page buffers, a page per slot), addressed in the one
page-id space after the main pool's pages and the SWA pool's (none here: a model has either):
`wire_id = state_base + slot`. A model without any K/V (Mamba2, pool kind "none") registers
no main buffers: its page ids are addresses only, so none of them crosses and its room moves
the state slot alone.
"""
from __future__ import annotations

from typing import Any


def kv_pages_cross(plan: Any) -> bool:
    """Whether the main pool's pages carry bytes: False for a model whose recurrent state
    is all it keeps (Mamba2: state components, no K/V ones). A page-only plan (torch-free
    fakes, pool kind "none" without components of either kind) moves its fake pages."""
    return not (plan.state_components and not plan.components)


def state_base(plan: Any) -> int:
    """Wire id of state slot 0: after the main region's pages (0..num_pages, none without
    K/V) and the SWA region's (0..num_swa_pages, none without an SWA pool)."""
    main = plan.num_pages + 1 if kv_pages_cross(plan) else 0
    swa = plan.num_swa_pages + 1 if plan.has_swa_pool else 0
    return main + swa


def state_wire_ids(plan: Any, req: Any) -> list[int]:
    """The wire id of the request's working state slot (what the room moves last), [] for a
    model without recurrent state."""
    if not plan.has_state_pool:
        return []
    assert req.state_slot, f"{req.rid}: no state slot to send or receive"
    return [state_base(plan) + req.state_slot]


def state_pages(plan: Any) -> int:
    """State "pages" a room moves: the final state slot, one (0 without recurrent state)."""
    return 1 if plan.has_state_pool else 0


__all__ = ["kv_pages_cross", "state_base", "state_pages", "state_wire_ids"]
