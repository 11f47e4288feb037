"""The measured speculation gate: per batch-size range it prices one more forward position
against a plain step's cost per token (rho), so requests draft where their acceptance pays
for it; it keeps probing both kinds of step; --speculative-disable-by-batch-size overrides."""
from __future__ import annotations

import math

from kvstrata.engine.sides.spec_gate import EXPLORE_EVERY, RHO_UNKNOWN, WARMUP, SpecGate


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run(gate: SpecGate, clock: Clock, batch: int, steps: int, fixed: float,
        per_position: float, drafts_per_req: int, accept_rate: float,
        draft_cost: float = 0.0) -> list[float]:
    """A machine whose step costs fixed + per_position x positions (+ draft_cost when
    anything drafts: a draft model's forward), requests whose drafts are accepted at
    `accept_rate` (their rate is known to the caller). Returns rho per step."""
    needs = []
    for _ in range(steps):
        need = gate.begin(batch)
        drafting = accept_rate >= need
        drafts = batch * drafts_per_req if drafting else 0
        positions = batch + drafts
        tokens = batch + round(drafts * accept_rate)
        clock.t += fixed + per_position * positions + (draft_cost if drafts else 0.0)
        gate.end(tokens, positions, drafts > 0)
        needs.append(need)
    return needs


def test_memory_bound_small_batches_draft_compute_bound_large_ones_do_not():
    clock = Clock()
    gate = SpecGate(None, clock)
    # batch 1: a forward is mostly a fixed cost (weights read once): positions are cheap
    run(gate, clock, 1, 40, fixed=50.0, per_position=2.0, drafts_per_req=4, accept_rate=0.3)
    # batch 32: the cost is per position
    run(gate, clock, 32, 40, fixed=20.0, per_position=5.0, drafts_per_req=2, accept_rate=0.3)
    state = gate.state()
    assert state["1"]["rho"] < 0.1          # 2 / (52 / 1): drafts at 30% acceptance pay
    assert 0.8 < state["32"]["rho"] <= 1.0  # 5 / (180 / 32): they do not


def test_warmup_explores_both_kinds_then_alternates_probes():
    clock = Clock()
    gate = SpecGate(None, clock)
    needs = run(gate, clock, 4, 4 * EXPLORE_EVERY, 10.0, 1.0, 2, 0.0)
    assert needs[:WARMUP] == [0.0] * WARMUP                 # everyone drafts
    assert needs[WARMUP:2 * WARMUP] == [math.inf] * WARMUP  # nobody does
    probes = [needs[i - 1] for i in range(EXPLORE_EVERY, len(needs) + 1, EXPLORE_EVERY)]
    assert set(probes) == {0.0, math.inf}


def test_unknown_marginal_cost_uses_the_prior():
    gate = SpecGate(None, Clock())
    assert gate.ranges == {} and gate.state() == {}
    gate.begin(2)
    assert gate.ranges[2].rho() == RHO_UNKNOWN


def test_explicit_limit_wins_and_measures_nothing():
    gate = SpecGate(8, Clock())
    assert gate.begin(8) == 0.0 and gate.begin(9) == math.inf
    gate.end(5, 9, True)
    assert gate.state() == {}


def test_untimed_drafting_steps_count_for_the_warm_up_but_not_the_averages():
    """A drafting step whose draft model rebuilt draft KV (STANDALONE's catch-up) is left
    out of the averages; a range where every drafting step was such assumes drafting never
    pays (nobody drafts outside probes), instead of guessing."""
    from kvstrata.engine.sides.spec_gate import RHO_MAX
    clock = Clock()
    gate = SpecGate(clock=clock)
    for _ in range(WARMUP):
        assert gate.begin(32) == 0.0 and gate.probing
        clock.t += 1.0
        gate.end(40, 36, drafted=True, timed=False)
    for _ in range(WARMUP):
        assert gate.begin(32) == math.inf and not gate.probing
        clock.t += 0.2
        gate.end(32, 32, drafted=False)
    assert gate.begin(32) == RHO_MAX
    clock.t += 0.2
    gate.end(32, 32, drafted=False)
    # One timed drafting step and the measured price is back.
    gate.ranges[6].steps = EXPLORE_EVERY - 1  # the next step is an exploration
    while not gate.probing:
        clock.t += 0.2
        gate.end(32, 32, drafted=False)
        gate.begin(32)
    clock.t += 0.21  # 4 more positions for 10 ms: rho = 2.5 ms / (200 ms / 32) = 0.4
    gate.end(36, 36, drafted=True)
    assert gate.ranges[6].rho() < RHO_MAX


def test_where_drafting_cannot_pay_probes_back_off():
    """rho >= 1 (a compute-bound batch): every step is plain and measured anyway, so the
    explorations are probes only, each twice as far from the last, up to EXPLORE_MAX."""
    from kvstrata.engine.sides.spec_gate import EXPLORE_MAX
    clock = Clock()
    gate = SpecGate(None, clock)
    needs = run(gate, clock, 32, 2000, fixed=20.0, per_position=5.0, drafts_per_req=4,
                accept_rate=0.3, draft_cost=400.0)
    assert gate.ranges[6].rho() >= 1.0
    probes = [i for i, need in enumerate(needs) if need == 0.0][WARMUP:]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY, 8 * EXPLORE_EVERY,
                        16 * EXPLORE_EVERY] and set(gaps[4:]) == {EXPLORE_MAX}, gaps
    assert len(probes) < 2000 // (2 * EXPLORE_EVERY) // 4  # vs one every 2 x 16 steps


def test_a_larger_batch_range_inherits_a_settled_verdict_that_drafting_does_not_pay():
    """A position costs relatively more as the batch grows: above a settled range where
    drafting does not pay, a new range skips the drafting warm-up (nobody drafts but its
    probes); above a paying range, a new range warms up as usual."""
    from kvstrata.engine.sides.spec_gate import RHO_MAX
    clock = Clock()
    gate = SpecGate(None, clock)
    run(gate, clock, 8, 40, fixed=10.0, per_position=5.0, drafts_per_req=4, accept_rate=0.3,
        draft_cost=100.0)
    assert gate.ranges[4].rho() >= 1.0
    for _ in range(WARMUP):  # plain steps only, no drafting warm-up
        assert gate.begin(32) == math.inf and not gate.probing
        clock.t += 100.0
        gate.end(32, 32, drafted=False)
    assert gate.begin(32) == RHO_MAX and not gate.probing

    clock = Clock()
    gate = SpecGate(None, clock)
    run(gate, clock, 1, 40, fixed=50.0, per_position=2.0, drafts_per_req=4, accept_rate=0.3)
    assert gate.ranges[1].rho() < 1.0
    assert gate.begin(32) == 0.0 and gate.probing  # its own warm-up
