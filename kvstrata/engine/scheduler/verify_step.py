"""The scheduler's half of speculative decoding (no torch): asking the sides for drafts
before a decode step, and settling a verify step's KV after it (engine/sides/speculative.py has the
drafting side, runner/spec/verify.py the acceptance)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.engine.sides.base import SchedulerSide
from kvstrata.protocol.scheduler_output import TreeDraft

if TYPE_CHECKING:  # annotations only: no import circle
    from kvstrata.engine.request import Request
    from kvstrata.engine.scheduler.core import Scheduler


def collect_drafts(sched: Scheduler) -> dict[str, list[int]] | None:
    """The sides' draft tokens per running request (None: no side drafts at all). Bounded
    so that every draft could be accepted without passing max_new_tokens or the context
    length."""
    if not any(type(side).draft is not SchedulerSide.draft for side in sched.sides):
        return None
    for side in sched.sides:
        side.begin_decode(len(sched.running))
    ctx = sched.stop_checker.max_context_len
    drafts = {}
    for req in sched.running:
        # Every draft token takes a position of the row (a tree's nodes too); accepted
        # ones (a tree: as many as it is deep) must not pass max_new_tokens either.
        slots = ctx - req.seq_len - 1
        limit = min(req.remaining_new_tokens() - 1, slots)
        d = next(filter(None, (side.draft(req, limit, slots) for side in sched.sides)), None)
        if d:
            drafts[req.rid] = d[:max(slots if isinstance(d, TreeDraft) else limit, 0)]
    return drafts


def settle_verified(drafted: dict[str, tuple[int, int]], by_id: dict[str, Request],
                    rids: list[str]) -> dict[str, int]:
    """A verify entry computed its last token plus every draft; only the accepted drafts
    hold valid KV. Before any token is appended (or a stop ends the request),
    num_computed goes back to start + tokens produced (the last token and the accepted
    drafts). Returns rid -> tokens produced."""
    if not drafted:
        return {}
    produced = {rid: 0 for rid in drafted if rid in by_id}
    for rid in rids:
        if rid in produced:
            produced[rid] += 1
    for rid, n in list(produced.items()):
        if n == 0:  # nothing came back for it (a side consumed it): leave it as is
            del produced[rid]
            continue
        req = by_id[rid]
        start = drafted[rid][0]
        req.num_computed_tokens = start + n
        req.row_stale_from = min(req.row_stale_from, start + n)
    return produced


def clamp_computed(req: Request) -> None:
    """A request ending while a verify ran (abort) or with a stop inside a verified run: only
    the committed tokens count as computed (their KV is what may reach the tree). Where that
    cuts back, a recurrent model's working state slot holds the state after every accepted
    draft, past the request's end: it must not be donated as the snapshot there."""
    if req.num_computed_tokens > req.seq_len:
        req.num_computed_tokens = req.seq_len
        req.state_past_end = True


def after_verified(sched: Scheduler, drafted: dict[str, tuple[int, int]],
                   by_id: dict[str, Request], produced: dict[str, int]) -> None:
    """After the tokens are appended: the pages of rejected drafts go back to the pool, and
    the sides count the pass."""
    for rid, n in produced.items():
        req = by_id[rid]
        num_draft = drafted[rid][1]
        if not req.is_finished and num_draft:
            sched.kv.trim(req, req.seq_len)
        for side in sched.sides:
            side.on_verified(req, num_draft, n)
