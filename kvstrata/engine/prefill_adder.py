"""Decides which waiting requests join the next prefill batch (no torch).

Budgets, in tokens (SGLang's PrefillAdder):
  rem_total  = free + evictable - sum over running requests of their reserved decode tokens;
               a new request needs extend_len + min(max_new_tokens, 4096) of it.
  rem_input  = --max-prefill-tokens for the whole batch (one oversized request may still run
               alone).
  rem_chunk  = --chunked-prefill-size; a request that does not fit is truncated to a whole
               number of pages and becomes the (single) chunked request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.engine.new_token_ratio import CLIP_MAX_NEW_TOKENS_ESTIMATION


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
    items: list[PrefillItem] = field(default_factory=list)

    def budget_exhausted(self) -> bool:
        return self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0)

    def try_add(self, req, remaining_len: int) -> PrefillItem | None:
        """Add `req` whose uncomputed tail is `remaining_len` tokens; None = stop adding."""
        if self.budget_exhausted():
            return None
        reserve = min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS_ESTIMATION)
        extend = remaining_len
        if self.rem_chunk is not None and extend > self.rem_chunk:
            extend = self.rem_chunk // self.page_size * self.page_size
            if extend <= 0:
                return None
            reserve = 0  # the request does not decode until its last chunk
        if self.running_empty and not self.items:
            reserve = min(reserve, max(self.rem_total - extend - 1, 0))
        if extend + reserve >= self.rem_total:
            return None
        if extend > self.rem_input and self.items:
            return None
        item = PrefillItem(req, extend, is_last_chunk=extend == remaining_len)
        self.items.append(item)
        self.rem_total -= extend + reserve
        self.rem_input -= extend
        if self.rem_chunk is not None:
            self.rem_chunk -= extend
        return item
