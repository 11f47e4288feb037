"""Decides which requests join the next prefill batch (no torch).

Budgets, in tokens (SGLang's PrefillAdder):
  rem_total  = free + evictable - sum over running requests of their reserved decode tokens.
               A NEW request is admitted only if its whole uncomputed input plus
               min(max_new_tokens, 4096), in whole pages, fits in it -- also when it will be
               chunked, so that an admitted chunked request can finish (SGLang checks the
               full input before truncating it to a chunk).
  rem_input  = --max-prefill-tokens for the whole batch (one oversized request may still run
               alone).
  rem_chunk  = --chunked-prefill-size; a request that does not fit is truncated to a whole
               number of pages and becomes the (single) chunked request.
  rem_swa    = hybrid SWA memory only: free + SWA-evictable SWA tokens - what running requests
               may still add to their SWA pages (at most one window each: out-of-window pages
               are released as they go). A request costs the pages of its extend plus, on
               its last chunk, up to one window of decode; an extend that does not fit is cut
               to whole pages (the request is chunked even without --chunked-prefill-size),
               so a prompt longer than the SWA pool still runs, a chunk at a time.
A recurrent-state model's request may also end a chunk at a branch point (`cap`,
branch_cap: cache/state_slots.py on_match), where the prefix cache snapshots its state.
The chunked request's next chunk goes first and is cut to what rem_total allows (SGLang's
add_chunked_req); when not even one page is left it is blocked and nobody else is admitted
this step, so new arrivals cannot starve it.

Costs are counted in whole pages (a 9-token extend with 4-token pages costs 12 tokens):
the budget must not promise more than the allocator can give.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.engine.scheduler.new_token_ratio import CLIP_MAX_NEW_TOKENS_ESTIMATION

if TYPE_CHECKING:  # annotations only: no import circle
    from kvstrata.engine.scheduler.core import Scheduler


@dataclass
class PrefillItem:
    req: object
    extend_len: int  # tokens to compute in this batch
    is_last_chunk: bool


@dataclass
class PrefillAdder:
    page_size: int
    rem_total: int
    rem_input: int
    rem_chunk: int | None
    # With nothing running, the decode reservation is waived for the first request so a
    # request whose max_new_tokens exceeds the pool still starts (retraction/abort handle
    # running out later) instead of waiting forever.
    running_empty: bool = False
    rem_swa: int | None = None  # None: no SWA pool (swa_budget)
    swa_cap: int = 0  # SWA tokens a request holds beyond its extend (one window)
    items: list[PrefillItem] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.rem_chunk is not None:
            # A chunk is whole pages and at least one page (a smaller chunk could never move).
            self.rem_chunk = max(self.rem_chunk // self.page_size, 1) * self.page_size

    def _page_cost(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def budget_exhausted(self) -> bool:
        # A cut item (the batch's one chunked request) ends the batch: rem_chunk reaches 0
        # then, but an SWA cut leaves it (and rem_input) untouched.
        return (self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0)
                or any(not item.is_last_chunk for item in self.items))

    def _reserve(self, req) -> int:
        return min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS_ESTIMATION)

    def _append(self, req, extend: int, remaining_len: int, reserve: int) -> PrefillItem:
        item = PrefillItem(req, extend, is_last_chunk=extend == remaining_len)
        self.items.append(item)
        self.rem_total -= self._page_cost(extend) + (reserve if item.is_last_chunk else 0)
        if self.rem_swa is not None:
            self.rem_swa -= self._page_cost(extend) + (
                min(reserve, self.swa_cap) if item.is_last_chunk else 0)
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend
        return item

    def add_chunked(self, req, remaining_len: int, cap: int | None = None
                    ) -> PrefillItem | None:
        """The in-progress chunked request's next chunk, cut to the budget (and to `cap`
        tokens); None = blocked."""
        extend = min(remaining_len, cap or remaining_len)
        if self.rem_chunk is not None:
            extend = min(extend, self.rem_chunk)
        if self._page_cost(extend) > self.rem_total:
            extend = max(self.rem_total, 0) // self.page_size * self.page_size
        if extend <= 0:
            return None
        if extend < remaining_len:
            extend = extend // self.page_size * self.page_size  # later chunks start page-aligned
        # No SWA reserve here: once running, swa_budget reserves its window growth.
        extend = self._swa_fit(extend, remaining_len, 0, True)
        if extend <= 0:
            return None
        return self._append(req, extend, remaining_len, self._reserve(req))

    def _swa_fit(self, extend: int, remaining_len: int, reserve: int, alone: bool) -> int:
        """`extend` cut to the SWA budget (0: no room). The last chunk also reserves up to
        a window of decode, waived for a request that runs alone (as rem_total's reserve)."""
        if self.rem_swa is None:
            return extend
        reserve = 0 if alone and self.running_empty else min(reserve, self.swa_cap)
        if extend < remaining_len or self._page_cost(extend) + reserve > self.rem_swa:
            limit = remaining_len - 1 if extend == remaining_len else extend
            extend = min(limit, max(self.rem_swa, 0)) // self.page_size * self.page_size
        return extend

    def _plan(self, req, remaining_len: int, rem_total: int,
              running_empty: bool | None = None, cap: int | None = None
              ) -> tuple[int, int] | None:
        """(extend, reserve) for a waiting request against `rem_total`, or None."""
        if self.budget_exhausted():
            return None
        reserve = self._reserve(req)
        if (self.running_empty if running_empty is None else running_empty) and not self.items:
            reserve = min(reserve, max(rem_total - remaining_len, 0))
        if self._page_cost(remaining_len + reserve) > rem_total:
            return None
        extend = remaining_len
        if self.rem_chunk is not None and extend > self.rem_chunk:
            # Cut to whole pages, so that the next chunk starts on a page boundary.
            extend = self.rem_chunk // self.page_size * self.page_size
            if extend <= 0:
                return None
        extend = min(extend, cap or extend)  # whole pages: a branch point
        extend = self._swa_fit(extend, remaining_len, reserve, not self.items)
        if extend <= 0:
            return None
        if extend > self.rem_input and self.items:
            return None
        return extend, reserve

    def fits(self, req, remaining_len: int, pinned_tokens: int = 0, freed_tokens: int = 0,
             running_empty: bool | None = None) -> bool:
        """Dry run of try_add, with `pinned_tokens` more taken out of the budget and
        `freed_tokens` given back (what a preemption would free; `running_empty`: whether
        nothing would run after it)."""
        return self._plan(req, remaining_len, self.rem_total - pinned_tokens + freed_tokens,
                          running_empty) is not None

    def try_add(self, req, remaining_len: int, cap: int | None = None) -> PrefillItem | None:
        """Add a waiting `req` whose uncomputed tail is `remaining_len` tokens (its first
        chunk at most `cap`); None = stop."""
        plan = self._plan(req, remaining_len, self.rem_total, cap=cap)
        if plan is None:
            return None
        return self._append(req, plan[0], remaining_len, plan[1])


def branch_cap(req) -> int | None:
    """Tokens up to the branch point where the request's prefill ends a chunk for a state
    snapshot (recurrent state), None where it has none ahead."""
    end = req.state_branch_end
    return end - req.num_computed_tokens if end > req.num_computed_tokens else None


def swa_budget(sched: Scheduler) -> dict:
    """PrefillAdder's SWA fields (none without an SWA pool): each running request may still
    grow its SWA pages up to one window (SWAPages.per_request_tokens), by at most its
    reserved decode tokens."""
    kv = sched.kv
    if kv.swa is None:
        return {}
    cap = kv.swa.per_request_tokens
    reserved = sum(min(sched.ratio.reserved_tokens(r), max(cap - kv.swa.held_tokens(r), 0))
                   for r in sched.running)
    return {"rem_swa": kv.swa_allocatable_tokens() - reserved, "swa_cap": cap}


LPM_FALLBACK_QUEUE_LEN = 128  # beyond this, longest-prefix ordering costs more than it saves


def prefill_candidates(sched: Scheduler) -> list:
    """The waiting queue in admission order: a side's order where one keeps it (priority
    scheduling, engine/sides/priority.py), else fcfs, lof (longest max_new_tokens first, fcfs on ties), or
    lpm (longest cached prefix first, fcfs on ties) while the queue is short enough for the
    prefix look-ups to pay."""
    cfg = sched.config
    for side in sched.sides:
        order = side.admission_order(sched.waiting)
        if order is not None:
            return order
    if cfg.schedule_policy == "lof":
        return sorted(sched.waiting, key=lambda r: -r.params.max_new_tokens)
    if cfg.schedule_policy == "lpm" and len(sched.waiting) <= LPM_FALLBACK_QUEUE_LEN:
        prefix = {id(r): sched.kv.peek_prefix_len(r.all_ids, salt=r.cache_salt)
                  for r in sched.waiting}
        return sorted(sched.waiting, key=lambda r: -prefix[id(r)])
    return list(sched.waiting)
