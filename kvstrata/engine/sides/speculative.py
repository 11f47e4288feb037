"""Speculative decoding's scheduler side (no torch): it proposes draft tokens for each
decode step and keeps the accept statistics; the scheduler core verifies nothing itself.

Per decode step the scheduler asks `draft(req, limit)` for every running request; a request
with a draft is scheduled as one verify entry [last token, d1 .. dk] (positions seq_len - 1
.. seq_len - 1 + k, slots from the same allocator). The runner runs the target over all of
it and accepts the longest prefix the target agrees with plus one token of its own (greedy,
or rejection sampling that keeps the output distribution, runner/spec/verify.py); the
scheduler appends those tokens one by one (stop conditions cut them exactly) and frees the
pages left past the committed tokens. Then `on_verified` counts the step.

NGRAM drafts come from an n-gram cache of every prompt and output (engine/sides/ngram_cache.py).
STANDALONE, EAGLE / EAGLE3 and NEXTN drafts come from the runner (a draft model; a head
reading the target's hidden states; the checkpoint's own MTP layer): this side only decides
how many draft positions a request gets (RUNNER_DRAFT placeholders; the runner fills in the
tokens, runner/spec/standalone.py, runner/spec/eagle.py, runner/spec/mtp.py,
runner/spec/mtp_hybrid.py).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvstrata.engine.sides.base import SchedulerSide
from kvstrata.engine.sides.ngram_cache import NgramCache
from kvstrata.engine.sides.spec_gate import SpecGate
from kvstrata.protocol.scheduler_output import RUNNER_DRAFT, TreeDraft

if TYPE_CHECKING:  # annotations only: no import circle
    from kvstrata.engine.scheduler.facade import SchedulerFacade

MIN_BUDGET = 1  # a request always keeps one draft token: the probe that lets it grow back
START_BUDGET = 1 << 30  # capped at num_draft_tokens - 1: a new request drafts in full
PRIOR_RATE = 0.5   # the population's acceptance rate before any verify
RATE_ALPHA = 0.5   # weight of the newest verify step in a request's acceptance rate
POP_ALPHA = 0.05   # ... and in the population's (every request's verifies)
# A request's own rate is evidence about its recent text; the longer it has not drafted, the
# less it says (text that diverged from the draft may converge again: a quote, a list, code),
# so its estimate decays toward the population's by this factor per step without a draft.
# A new request starts at the population's rate.
IDLE_DECAY = 0.85
MAX_RATE = 0.95  # a rate estimate of 1.0 would make every draft length look free
# Requests that draft in a gate's probe step: NGRAM drafts cost only verify positions (4
# requests, their usual drafts); a draft model's probe also runs the draft model and rebuilds
# the prober's draft KV (its prompt, or what it decoded plainly since): 1 request, 1 token.
PROBE_REQUESTS = {"NGRAM": 4}
PROBE_REQUESTS_DRAFT_MODEL = 1


class SpeculativeSide(SchedulerSide):
    counters = {
        "spec_verify_steps": "Speculative verify passes (one per request per decode step)",
        "spec_drafted_tokens": "Draft tokens proposed for verification",
        "spec_accepted_tokens": "Tokens produced by verify passes (accepted drafts + 1 each)",
    }

    def __init__(self, sched: SchedulerFacade):
        cfg = sched.config
        self.algorithm = cfg.speculative_algorithm
        # PD decode + NEXTN: first draft rounds by seed outcome (runner/spec/handoff.py)
        self.dsa_seed: dict[str, int] = {}
        self.num_draft_tokens = cfg.speculative_num_draft_tokens
        self.cache = NgramCache(cfg.speculative_ngram_branch_length,
                                cfg.speculative_ngram_min_match_window_size,
                                cfg.speculative_ngram_max_match_window_size,
                                cfg.speculative_ngram_capacity)
        # NGRAM trees (SGLang's BFS / PROB drafts) when a node may have several children.
        self.min_breadth = cfg.speculative_ngram_min_bfs_breadth
        self.max_breadth = cfg.speculative_ngram_max_bfs_breadth or 1
        self.match_type = cfg.speculative_ngram_match_type
        self.tree = self.match_type == "PROB" or self.max_breadth > 1
        # A draft model's tree: the runner expands the top-k per node, num_steps deep.
        self.runner_tree = (self.algorithm != "NGRAM"
                            and (getattr(cfg, "speculative_eagle_topk", None) or 1) > 1)
        self.num_steps = getattr(cfg, "speculative_num_steps", None) or 1
        self._depth: dict[str, int] = {}  # rid -> depth of its last draft (trees)
        self._fed: dict[str, int] = {}  # rid -> tokens of it already in the cache
        self._budget: dict[str, int] = {}  # rid -> drafts it may propose next (see _adapt)
        # Whether this decode step drafts: --speculative-disable-by-batch-size, or measured.
        self.gate = SpecGate(getattr(cfg, "speculative_disable_by_batch_size", None))
        self._need = 0.0      # acceptance rate a request needs to draft in this step
        self._probe_stride = 0  # >0 in a probe step: every stride-th request drafts
        self._probe_turn = 0    # rotates which requests a probe step lets draft
        self._asked = 0         # draft() calls in this step
        self._rate: dict[str, float] = {}  # rid -> recent accepted / drafted
        self._pop_rate = PRIOR_RATE  # every request's recent accepted / drafted
        self._drafted_at: dict[str, int] = {}  # rid -> decode step of its last draft
        self._decode_steps = 0
        self._step_tokens = self._step_drafts = self._step_drafts_accepted = 0
        self._step_drafting = 0  # requests that verified drafts in this step
        self.verify_steps = 0      # decode steps of requests (each one verify pass)
        self.accepted_tokens = 0   # tokens those passes produced (accepted drafts + 1 each)
        self.drafted_tokens = 0

    # ---- hooks
    def take(self, req) -> bool:
        if self.algorithm == "NGRAM":
            self.cache.extend(req.rid, req.prompt_ids)
            self._fed[req.rid] = len(req.prompt_ids)
        return False  # only watches arrivals

    def begin_decode(self, batch: int) -> None:
        self._need = self.gate.begin(batch)
        self._decode_steps += 1
        self._asked = 0
        self._step_drafting = 0
        probers = PROBE_REQUESTS.get(self.algorithm, PROBE_REQUESTS_DRAFT_MODEL)
        self._probe_stride = -(-batch // probers) if self.gate.probing else 0
        self._probe_turn += bool(self._probe_stride)
        self._step_tokens = self._step_drafts = self._step_drafts_accepted = 0

    def draft(self, req, limit: int, max_nodes: int | None = None) -> list[int]:
        """Draft tokens to verify after `req`'s last token (at most `limit`, and at most
        the request's current draft budget); none in a step the gate keeps plain."""
        self._asked += 1
        if (limit <= 0 or req.params.max_new_tokens == 0
                or self.expected_rate(req.rid) < self._need):
            return []
        budget = self._budget.get(req.rid, min(START_BUDGET, self.num_draft_tokens - 1))
        if self._probe_stride:  # a measuring step: a few requests (a draft model: one token)
            if (self._asked + self._probe_turn) % self._probe_stride:
                return []
            if self.algorithm != "NGRAM":
                budget = 1
        if self.algorithm != "NGRAM":  # a draft model in the runner proposes the tokens
            if self.runner_tree and budget > 1 and limit >= self.num_steps:
                self._depth[req.rid] = self.num_steps
                nodes = budget if max_nodes is None else min(budget, max_nodes)
                return TreeDraft([RUNNER_DRAFT] * nodes, None)
            return [RUNNER_DRAFT] * min(limit, budget)
        self._feed(req)
        if not self.tree:
            return self.cache.draft(req.all_ids, min(limit, budget))
        nodes = budget if max_nodes is None else min(budget, max_nodes)
        draft = self.cache.draft_tree(req.all_ids, nodes, self.min_breadth, self.max_breadth,
                                      self.match_type, max_depth=limit)
        self._depth[req.rid] = draft.depth()
        return draft

    def expected_rate(self, rid: str) -> float:
        """The acceptance rate `rid`'s next draft is expected to have: its own recent rate,
        pulled toward the population's the longer it has not drafted (IDLE_DECAY)."""
        own = self._rate.get(rid)
        if own is None:
            return self._pop_rate
        idle = max(0, self._decode_steps - self._drafted_at.get(rid, self._decode_steps) - 1)
        return self._pop_rate + (own - self._pop_rate) * IDLE_DECAY ** idle

    def on_verified(self, req, drafted: int, produced: int) -> None:
        """A decode step of `req` verified `drafted` drafts (0: nothing matched, a plain
        step) and produced `produced` tokens (accepted + 1). Every decode step counts, so
        the accept length is tokens per target forward, as SGLang reports it."""
        self.verify_steps += 1
        self.accepted_tokens += produced
        self.drafted_tokens += drafted
        self._step_tokens += produced
        self._step_drafts += drafted
        self._step_drafting += drafted > 0
        self._step_drafts_accepted += produced - 1
        if drafted:
            self._adapt(req.rid, drafted, produced - 1)
        req.spec_verify_ct += 1
        req.spec_draft_tokens += drafted
        req.spec_accepted_drafts += produced - 1

    def _adapt(self, rid: str, drafted: int, accepted: int) -> None:
        """Per-request draft budget: every draft token costs a position in the verify
        forward, so a request whose drafts keep failing drafts less (halved when none was
        accepted, down to MIN_BUDGET) and one whose drafts all pass drafts more again
        (doubled, up to num_draft_tokens - 1); a partial accept keeps it (copying text
        diverges now and then, then goes on). Exactness does not depend on it."""
        rate = self._rate.get(rid, self._pop_rate)
        self._rate[rid] = rate + RATE_ALPHA * (accepted / drafted - rate)
        self._pop_rate += POP_ALPHA * (accepted / drafted - self._pop_rate)
        self._drafted_at[rid] = self._decode_steps
        top = self.num_draft_tokens - 1
        budget = self._budget.get(rid, min(START_BUDGET, top))
        if accepted >= self._depth.pop(rid, drafted):  # the whole chain, a tree's deepest
            budget = max(min(top, budget * 2), self._paying_budget(self._rate[rid], top))
        elif accepted == 0:
            budget = max(MIN_BUDGET, budget // 2)
        self._budget[rid] = budget

    def _paying_budget(self, rate: float, top: int) -> int:
        """After a fully accepted draft: the draft length that pays best at the measured
        cost of a position (rho, this step's), if each further draft token is right with
        `rate`: argmax over k of (1 + rate + ... + rate^k) / (1 + k * rho), tokens per unit
        of plain-step cost. Where positions are cheap (batch 1: rho ~0.07) and the request
        keeps being right, it drafts in full at once instead of doubling back up from one
        token (1, 2, 4, 7: three short steps in each copied run); where they are dear (batch
        32) the doubling stays. 1 when rho is not measured (a fixed gate, a probe)."""
        rho = self._need
        if not 0.0 < rho < math.inf:
            return 1
        best_k, best, gain, term = 1, 0.0, 1.0, 1.0
        for k in range(1, top + 1):
            term *= min(rate, MAX_RATE)
            gain += term
            value = gain / (1.0 + k * rho)
            if value > best:
                best_k, best = k, value
        return best_k

    def on_runner_output(self, result) -> list:
        # (a no-op after a prefill step: the gate only times decode steps it began). A step
        # whose draft model rebuilt draft KV (more than 2 tokens a request) is not timed.
        for outcome, n in result.dsa_seed_outcomes.items():
            self.dsa_seed[outcome] = self.dsa_seed.get(outcome, 0) + n
        catch_up = result.draft_catch_up_tokens
        self.gate.end(self._step_tokens, self._step_tokens - self._step_drafts_accepted
                      + self._step_drafts, self._step_drafts > 0,
                      timed=catch_up <= 2 * self._step_drafting)
        self._step_tokens = self._step_drafts = self._step_drafts_accepted = 0
        self._step_drafting = 0
        return []

    def on_finish(self, req) -> None:
        if req.rid in self._fed:
            self._feed(req)  # its output still teaches the cache
            del self._fed[req.rid]
        self.cache.forget(req.rid)
        self._budget.pop(req.rid, None)
        self._rate.pop(req.rid, None)
        self._drafted_at.pop(req.rid, None)
        self._depth.pop(req.rid, None)

    def _feed(self, req) -> None:
        seen = self._fed.get(req.rid)
        if seen is None:  # arrived through a side that took it (a PD decode room)
            seen = 0
        ids = req.all_ids
        if len(ids) > seen:
            self.cache.extend(req.rid, ids[seen:])
        self._fed[req.rid] = len(ids)

    def reset_cache(self) -> None:
        """Forget every n-gram (benchmarks: each run starts from what its prompts teach)."""
        self.cache = NgramCache(self.cache.branch_length, self.cache.min_window,
                                self.cache.max_window, self.cache.capacity)
        self._fed.clear()

    # ---- state
    def avg_accept_length(self) -> float:
        return self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    def load(self) -> dict:
        return {"spec_verify_steps": self.verify_steps,
                "spec_accepted_tokens": self.accepted_tokens,
                "spec_drafted_tokens": self.drafted_tokens,
                "avg_spec_accept_length": round(self.avg_accept_length(), 4),
                "spec_gate": self.gate.state(),
                **{f"spec_dsa_seed_{k}": v for k, v in sorted(self.dsa_seed.items())}}

    def dump_lines(self, brief) -> list[str]:
        return [f"speculative {self.algorithm}: {self.verify_steps} verify passes, avg accept "
                f"length {self.avg_accept_length():.2f}, n-gram cache {self.cache.num_nodes} "
                f"nodes"]


__all__ = ["SpeculativeSide"]
