"""Which requests draft in a decode step (no torch). A draft token costs one position of
the verify forward and pays only when accepted: on a CPU at batch 1 a forward of a few
extra positions costs little more than one token, at batch 32 it is compute-bound and every
position costs about what a token costs. So the rule is per request and per batch size:

    a request drafts iff its recent acceptance rate >= rho(batch range),
    rho = marginal cost of one more forward position / cost per token of a plain step.

Measured while serving, per batch-size range (powers of two: 1, 2-3, 4-7, ...): exponential
averages of a step's wall time and forward positions, for steps with drafts and for plain
steps, give the marginal cost b = (t_spec - t_plain) / (positions_spec - positions_plain)
and rho = b / (t_plain / positions_plain). A range first takes WARMUP steps where every
request drafts and WARMUP plain ones; later every EXPLORE_EVERY-th step is one of either kind
(alternating) so the averages, and each request's acceptance rate, stay current. Those
drafting steps are probes (`probing`): the side lets only a few requests draft in them (with
a draft model, one token), so measuring stays cheap where drafting does not pay (a draft
model's forwards, or a compute-bound batch of 32). Where drafting cannot pay (rho >= 1: no
acceptance rate reaches it) every step is plain and measured anyway, so explorations are
probes only, each twice as far from the last (up to EXPLORE_MAX steps), back to
EXPLORE_EVERY once rho drops below 1. And a position costs relatively more as the batch
grows (a step turns from memory- to compute-bound), so a new range above a settled one
where drafting does not pay starts as not paying: no drafting warm-up, only the probes.
`--speculative-disable-by-batch-size N` (vLLM's flag) replaces all this: every request may
draft in steps of at most N requests, none above. Exactness never depends on the choice.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

WARMUP = 3
EXPLORE_EVERY = 16
EXPLORE_MAX = 16 * EXPLORE_EVERY
ALPHA = 0.3          # weight of the newest sample in the averages
RHO_UNKNOWN = 0.5    # before the marginal cost is measurable
RHO_MIN, RHO_MAX = 0.02, 2.0


@dataclass
class _Avg:
    n: int = 0
    seconds: float = 0.0
    positions: float = 0.0

    def add(self, seconds: float, positions: int) -> None:
        a = 1.0 if self.n == 0 else ALPHA
        self.seconds += a * (seconds - self.seconds)
        self.positions += a * (positions - self.positions)
        self.n += 1


@dataclass
class _Range:
    steps: int = 0
    spec: _Avg = None  # type: ignore[assignment]
    plain: _Avg = None  # type: ignore[assignment]
    spec_seen: int = 0  # drafting steps, timed or not (the warm-up counts these)
    interval: int = EXPLORE_EVERY      # steps between explorations
    next_explore: int = EXPLORE_EVERY  # the step (count) of the next one
    explores: int = 0

    def __post_init__(self):
        self.spec, self.plain = _Avg(), _Avg()

    def settled(self) -> bool:
        return self.spec_seen >= WARMUP and self.plain.n >= WARMUP

    def rho(self) -> float:
        s, p = self.spec, self.plain
        if self.spec_seen >= WARMUP and not s.n:
            return RHO_MAX  # every drafting step here rebuilt draft KV: assume it never pays
        if not (s.n and p.n) or s.positions <= p.positions + 0.5 or p.seconds <= 0:
            return RHO_UNKNOWN
        marginal = (s.seconds - p.seconds) / (s.positions - p.positions)
        return min(max(marginal / (p.seconds / p.positions), RHO_MIN), RHO_MAX)


class SpecGate:
    def __init__(self, disable_by_batch_size: int | None = None, clock=time.perf_counter):
        self.limit = disable_by_batch_size
        self.clock = clock
        self.ranges: dict[int, _Range] = {}
        self._step: tuple[int, float] | None = None  # (range, start)
        self.probing = False  # this step drafts only to measure (warm-up or exploration)

    def begin(self, batch: int) -> float:
        """A decode step of `batch` requests starts: the acceptance rate a request needs
        to draft in it (0: everyone may, inf: nobody)."""
        self.probing = False
        if self.limit is not None:
            self._step = None
            return 0.0 if batch <= self.limit else math.inf
        key = batch.bit_length()
        r = self.ranges.get(key)
        if r is None:
            r = self.ranges[key] = _Range()
            if any(k < key and low.settled() and low.rho() >= 1.0
                   for k, low in self.ranges.items()):
                r.spec_seen = WARMUP  # drafting does not pay below: nor here (rho RHO_MAX)
        r.steps += 1
        self._step = (key, self.clock())
        if r.spec_seen < WARMUP:
            self.probing = True
            return 0.0
        if r.plain.n < WARMUP:
            return math.inf
        if r.steps >= r.next_explore:
            r.explores += 1
            pays = r.rho() < 1.0
            r.interval = EXPLORE_EVERY if pays else min(2 * r.interval, EXPLORE_MAX)
            r.next_explore = r.steps + r.interval
            # Paying: alternate the kinds (plain steps are then rare); not paying: every
            # step is plain already, so the exploration is a probe.
            self.probing = bool(r.explores % 2) or not pays
            return 0.0 if self.probing else math.inf
        return r.rho()

    def end(self, tokens: int, positions: int, drafted: bool, timed: bool = True) -> None:
        """The step's output arrived: `tokens` produced from `positions` forward positions
        (tokens = positions in a plain step); `drafted`: any draft was verified; `timed`
        False: an unusual step (a draft model rebuilt KV) left out of the averages; a range
        whose drafting steps were all such assumes drafting never pays there (RHO_MAX)."""
        if self._step is None:
            return
        key, start = self._step
        self._step = None
        if tokens > 0:
            r = self.ranges[key]
            r.spec_seen += drafted
            if timed:
                (r.spec if drafted else r.plain).add(self.clock() - start, positions)

    def state(self) -> dict:
        """Per range (its lowest batch size): ms per step each way and the current rho."""
        return {str(1 << (key - 1)): {
            "spec_step_ms": round(1000 * r.spec.seconds, 3) if r.spec.n else None,
            "plain_step_ms": round(1000 * r.plain.seconds, 3) if r.plain.n else None,
            "rho": round(r.rho(), 3)} for key, r in sorted(self.ranges.items())}
