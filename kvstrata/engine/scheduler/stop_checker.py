"""Decides whether a request is finished after it received a token (no torch)."""
from __future__ import annotations

import functools
import re
from typing import Any

from kvstrata.protocol import FinishReason

# Decoding only the last few tokens is enough to find a stop string that ends at the newest
# token; the margin covers tokens that are fragments of one multi-byte character.
_STOP_TAIL_MARGIN_TOKENS = 4


# Patterns matching more characters than this search the whole output (as unbounded ones).
_BOUNDED_CHARS = 4096


@functools.lru_cache(maxsize=256)
def max_match_chars(pattern: str) -> int | None:
    """The most characters a match of `pattern` can span, None when unbounded (or past
    _BOUNDED_CHARS, or not sized by Python's parser)."""
    try:
        width = re._parser.parse(pattern).getwidth()[1]  # noqa: SLF001 - the stdlib's own
    except Exception:  # noqa: BLE001 - an unsized pattern is searched in full
        return None
    return width if width <= _BOUNDED_CHARS else None


class StopChecker:
    def __init__(self, eos_token_ids: list[int], max_context_len: int, tokenizer: Any = None):
        self.eos_token_ids = set(eos_token_ids)
        self.max_context_len = max_context_len
        self.tokenizer = tokenizer

    def check(self, req) -> FinishReason | None:
        params = req.params
        generated = len(req.output_ids)
        if generated == 0:
            return None
        last = req.output_ids[-1]
        if generated >= params.min_new_tokens:
            if last in params.stop_token_ids:
                return FinishReason(type="stop", matched=last)
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishReason(type="stop", matched=last)
            if params.stop and self.tokenizer is not None:
                matched = self._match_stop_string(req)
                if matched is not None:
                    return FinishReason(type="stop", matched=matched)
            if params.stop_regex and self.tokenizer is not None:
                matched = self._match_stop_regex(req)
                if matched is not None:
                    return FinishReason(type="stop", matched=matched)
        if generated >= params.max_new_tokens:
            return FinishReason(type="length", matched=None)
        if req.seq_len >= self.max_context_len:
            return FinishReason(type="length", matched=None)
        return None

    def _match_stop_regex(self, req) -> str | None:
        """SGLang's stop_regex: the first pattern found in the decoded tail. The tail is as
        many tokens as the longest match has characters (one token holds at least one), plus
        the margin; an unbounded pattern (`a+`, `.*`) searches the whole output."""
        widths = [max_match_chars(p) for p in req.params.stop_regex]
        ids = req.output_ids
        if None not in widths:
            ids = ids[-(max(widths) + _STOP_TAIL_MARGIN_TOKENS):]
        tail = self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
        return next((p for p in req.params.stop_regex if re.search(p, tail)), None)

    def _match_stop_string(self, req) -> str | None:
        stops = req.params.stop
        longest = max(len(s) for s in stops)
        tail_ids = req.output_ids[-(longest + _STOP_TAIL_MARGIN_TOKENS):]
        tail = self.tokenizer.decode(tail_ids, skip_special_tokens=req.params.skip_special_tokens)
        # Only a match that touches the newest token is new; older ones were checked before.
        newest = self.tokenizer.decode(tail_ids[-1:], skip_special_tokens=False)
        window = tail[-(longest + len(newest)):]
        for s in stops:
            if s in window:
                return s
        return None
