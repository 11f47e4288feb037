"""Speculative decoding's scheduler side (no torch): it proposes draft tokens for each
decode step and keeps the accept statistics; the scheduler core verifies nothing itself.

Per decode step the scheduler asks `draft(req, limit)` for every running request; a request
with a draft is scheduled as one verify entry [last token, d1 .. dk] (positions seq_len - 1
.. seq_len - 1 + k, slots from the same allocator). The runner runs the target over all of
it and accepts the longest prefix the target agrees with plus one token of its own (greedy,
or rejection sampling that keeps the output distribution, runner/spec_verify.py); the
scheduler appends those tokens one by one (stop conditions cut them exactly) and frees the
pages left past the committed tokens. Then `on_verified` counts the step.

NGRAM drafts come from an n-gram cache of every prompt and output (engine/ngram_cache.py);
other algorithms (a draft model) are refused at start-up until built.
"""
from __future__ import annotations

from kvstrata.engine.ngram_cache import NgramCache
from kvstrata.engine.side import SchedulerSide


class SpeculativeSide(SchedulerSide):
    def __init__(self, sched):
        cfg = sched.config
        self.algorithm = cfg.speculative_algorithm
        self.num_draft_tokens = cfg.speculative_num_draft_tokens
        self.cache = NgramCache(cfg.speculative_ngram_branch_length,
                                cfg.speculative_ngram_min_match_window_size,
                                cfg.speculative_ngram_max_match_window_size,
                                cfg.speculative_ngram_capacity)
        self._fed: dict[str, int] = {}  # rid -> tokens of it already in the cache
        self.verify_steps = 0      # decode steps of requests (each one verify pass)
        self.accepted_tokens = 0   # tokens those passes produced (accepted drafts + 1 each)
        self.drafted_tokens = 0

    # ---- hooks
    def take(self, req) -> bool:
        self.cache.extend(req.rid, req.prompt_ids)
        self._fed[req.rid] = len(req.prompt_ids)
        return False  # only watches arrivals

    def draft(self, req, limit: int) -> list[int]:
        """Draft tokens to verify after `req`'s last token (at most `limit`)."""
        if limit <= 0 or req.params.max_new_tokens == 0:
            return []
        self._feed(req)
        return self.cache.draft(req.all_ids, min(limit, self.num_draft_tokens - 1))

    def on_verified(self, req, drafted: int, produced: int) -> None:
        """A decode step of `req` verified `drafted` drafts (0: nothing matched, a plain
        step) and produced `produced` tokens (accepted + 1). Every decode step counts, so
        the accept length is tokens per target forward, as SGLang reports it."""
        self.verify_steps += 1
        self.accepted_tokens += produced
        self.drafted_tokens += drafted
        req.spec_verify_ct += 1
        req.spec_draft_tokens += drafted
        req.spec_accepted_drafts += produced - 1

    def on_finish(self, req) -> None:
        if req.rid in self._fed:
            self._feed(req)  # its output still teaches the cache
            del self._fed[req.rid]
        self.cache.forget(req.rid)

    def _feed(self, req) -> None:
        seen = self._fed.get(req.rid)
        if seen is None:  # arrived through a side that took it (a PD decode room)
            seen = 0
        ids = req.all_ids
        if len(ids) > seen:
            self.cache.extend(req.rid, ids[seen:])
        self._fed[req.rid] = len(ids)

    # ---- state
    def avg_accept_length(self) -> float:
        return self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    def load(self) -> dict:
        return {"spec_verify_steps": self.verify_steps,
                "spec_accepted_tokens": self.accepted_tokens,
                "spec_drafted_tokens": self.drafted_tokens,
                "avg_spec_accept_length": round(self.avg_accept_length(), 4)}

    def dump_lines(self, brief) -> list[str]:
        return [f"speculative {self.algorithm}: {self.verify_steps} verify passes, avg accept "
                f"length {self.avg_accept_length():.2f}, n-gram cache {self.cache.num_nodes} "
                f"nodes"]


__all__ = ["SpeculativeSide"]
