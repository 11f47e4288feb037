"""Priority scheduling, preemption and the bounded queue (engine/sides/priority.py): every rule, in
exact order, against the fake runner (whose greedy tokens are a function of the sequence, so a
preempted request must still produce exactly the reference tokens)."""
from __future__ import annotations

import sys
import zlib
from types import SimpleNamespace

import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvstrata.config.server_args import ServerArgs
from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.request import EngineRequest
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.engine.sides.priority import (EVICTED_MESSAGE, PRIORITY_DISABLED_MESSAGE,
                                            QUEUE_FULL_MESSAGE, PrioritySide, resolve_priority)
from kvstrata.protocol import SamplingParams
from tests.unit.fake_runner import FakeRunner, reference_tokens

VOCAB = 1000
# 75 in `make test` (its 10-minute budget); KVSTRATA_FUZZ_EXAMPLES=N for depth.
EXAMPLES = int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "75"))
PRIO = dict(enable_priority_scheduling=True)


def make_engine(num_pages=256, max_running_requests=1, **cfg):
    runner = FakeRunner(page_size=1, vocab_size=VOCAB)
    config = SchedulerConfig(num_pages=num_pages, max_running_requests=max_running_requests,
                             **cfg)
    return EngineCore(runner, config), runner


def prompt(seed, n=6):
    return [(seed * 131 + i * 17) % VOCAB for i in range(n)]


def add(engine, rid, priority=None, n=4, seed=None):
    sp = SamplingParams(max_new_tokens=n, temperature=0)
    engine.add_request(EngineRequest(rid, prompt(seed if seed is not None else zlib.crc32(rid.encode()) % 997),
                                     sp, priority=priority))


class Run:
    """Steps an engine, recording the order of first prefills, of finishes, and outputs."""

    def __init__(self, engine, runner):
        self.engine, self.runner = engine, runner
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, object] = {}
        self.finish_order: list[str] = []
        self.started: list[str] = []

    def step(self, n=1):
        for _ in range(n):
            if not self.engine.has_unfinished_requests():
                return
            before = len(self.runner.steps)
            for out in self.engine.step():
                self.tokens.setdefault(out.rid, []).extend(out.new_token_ids)
                if out.finished:
                    self.finished[out.rid] = out
                    self.finish_order.append(out.rid)
            for sched_out in self.runner.steps[before:]:
                for entry in sched_out.scheduled:
                    if entry.start_pos == 0 and entry.rid not in self.started:
                        self.started.append(entry.rid)

    def drain(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        assert not self.engine.has_unfinished_requests(), self.engine.dump_state()
        self.engine.check_integrity()
        return self


# ---------------------------------------------------------------- default priority
def cfg(**kw):
    return SchedulerConfig(num_pages=8, **kw)


def test_default_priority_and_the_least_preferred_value():
    assert resolve_priority(cfg(), None) == (None, None)
    assert resolve_priority(cfg(default_priority_value=3), None) == (3, None)
    assert resolve_priority(cfg(default_priority_value=3), 7) == (7, None)
    assert resolve_priority(cfg(**PRIO), None) == (-sys.maxsize - 1, None)
    assert resolve_priority(cfg(**PRIO, schedule_low_priority_values_first=True),
                            None) == (sys.maxsize, None)
    assert resolve_priority(cfg(**PRIO, default_priority_value=5), None) == (5, None)
    # Disabled: ignored, unless the server refuses requests that carry one.
    assert resolve_priority(cfg(), 4) == (4, None)
    assert resolve_priority(cfg(abort_on_priority_when_disabled=True), 4)[1] \
        == PRIORITY_DISABLED_MESSAGE
    assert resolve_priority(cfg(abort_on_priority_when_disabled=True), None) == (None, None)


def test_priority_when_disabled_is_a_503_and_frees_nothing():
    engine, runner = make_engine(abort_on_priority_when_disabled=True)
    add(engine, "p", priority=1)
    add(engine, "q")
    run = Run(engine, runner).drain()
    reason = run.finished["p"].finish_reason
    assert (reason.type, reason.status_code, reason.message) == (
        "abort", 503, PRIORITY_DISABLED_MESSAGE)
    assert run.finished["q"].finish_reason.type == "length"


# ---------------------------------------------------------------- queue order
@pytest.mark.parametrize("low_first", [False, True])
def test_waiting_queue_order_by_priority_then_arrival(low_first):
    engine, runner = make_engine(**PRIO, disable_priority_preemption=True,
                                 schedule_low_priority_values_first=low_first)
    add(engine, "first", priority=0, n=2)
    Run(engine, runner).step()  # "first" runs; the rest queue behind it
    for rid, prio in [("a", 1), ("b", 5), ("c", 1), ("d", -3), ("e", 5)]:
        add(engine, rid, priority=prio, n=2)
    run = Run(engine, runner).drain()
    expected = ["d", "a", "c", "b", "e"] if low_first else ["b", "e", "a", "c", "d"]
    assert run.started == expected


def test_lof_breaks_priority_ties_by_longest_output():
    engine, runner = make_engine(**PRIO, disable_priority_preemption=True,
                                 schedule_policy="lof")
    add(engine, "first", priority=9, n=2)
    Run(engine, runner).step()
    for rid, prio, n in [("a", 1, 2), ("b", 1, 6), ("c", 2, 3), ("d", 1, 6)]:
        add(engine, rid, priority=prio, n=n)
    assert Run(engine, runner).drain().started == ["c", "b", "d", "a"]


def test_lof_without_priority_is_longest_output_first_fcfs_on_ties():
    engine, runner = make_engine(schedule_policy="lof")
    add(engine, "first", n=2)
    Run(engine, runner).step()
    for rid, n in [("a", 2), ("b", 6), ("c", 3), ("d", 6)]:
        add(engine, rid, n=n)
    assert Run(engine, runner).drain().started == ["b", "d", "c", "a"]


def test_lpm_with_priority_is_refused_naming_both_flags():
    with pytest.raises(ValueError, match="--enable-priority-scheduling.*--schedule-policy"):
        ServerArgs(enable_priority_scheduling=True, schedule_policy="lpm")
    ServerArgs(enable_priority_scheduling=True, schedule_policy="lof")


# ---------------------------------------------------------------- preemption
def test_high_priority_preempts_and_both_outputs_are_exact():
    engine, runner = make_engine(**PRIO)
    add(engine, "low", priority=0, n=30, seed=1)
    run = Run(engine, runner)
    run.step(5)
    add(engine, "high", priority=11, n=4, seed=2)
    run.drain()
    assert run.finish_order == ["high", "low"]
    assert run.tokens["low"] == reference_tokens(prompt(1), 30, VOCAB)
    assert run.tokens["high"] == reference_tokens(prompt(2), 4, VOCAB)
    assert engine.get_load()["num_preempted_reqs"] == 1


@pytest.mark.parametrize("low_first,high", [(False, 10), (True, -10)])
def test_a_difference_equal_to_the_threshold_does_not_preempt(low_first, high):
    engine, runner = make_engine(**PRIO, schedule_low_priority_values_first=low_first)
    add(engine, "low", priority=0, n=30, seed=1)
    run = Run(engine, runner)
    run.step(5)
    add(engine, "high", priority=high, n=4, seed=2)
    run.drain()
    assert run.finish_order == ["low", "high"]
    assert engine.get_load()["num_preempted_reqs"] == 0


def test_low_values_first_preempts_the_other_way():
    engine, runner = make_engine(**PRIO, schedule_low_priority_values_first=True,
                                 priority_scheduling_preemption_threshold=0)
    add(engine, "big", priority=5, n=30, seed=1)
    run = Run(engine, runner)
    run.step(5)
    add(engine, "small", priority=4, n=4, seed=2)
    run.drain()
    assert run.finish_order == ["small", "big"]


def test_disabled_preemption_waits():
    engine, runner = make_engine(**PRIO, disable_priority_preemption=True)
    add(engine, "low", priority=0, n=30, seed=1)
    run = Run(engine, runner)
    run.step(5)
    add(engine, "high", priority=100, n=4, seed=2)
    run.drain()
    assert run.finish_order == ["low", "high"]


def test_least_preferred_then_newest_is_preempted_first():
    engine, runner = make_engine(max_running_requests=3, **PRIO)
    run = Run(engine, runner)
    for rid, prio in [("old0", 0), ("mid", 5), ("new0", 0)]:
        add(engine, rid, priority=prio, n=40, seed=len(rid))
        run.step()
    add(engine, "vip", priority=50, n=3, seed=9)
    run.step(2)
    waiting = [r.rid for r in engine.scheduler.waiting]
    assert waiting == ["new0"], waiting  # one victim frees enough: the newest of priority 0
    run.drain()
    assert run.finish_order[0] == "vip"


def test_nobody_is_preempted_when_not_enough_would_be_freed():
    # 64 tokens of KV: "low" holds ~40; the newcomer needs more than everything low frees.
    engine, runner = make_engine(num_pages=64, **PRIO)
    add(engine, "low", priority=0, n=20, seed=1)
    run = Run(engine, runner)
    run.step(3)
    sp = SamplingParams(max_new_tokens=40, temperature=0)
    engine.add_request(EngineRequest("huge", prompt(3, 60), sp, priority=99))
    run.step()
    assert [r.rid for r in engine.scheduler.running] == ["low"]
    run.drain()
    assert engine.get_load()["num_preempted_reqs"] == 0


# ---------------------------------------------------------------- --max-queued-requests
def test_full_queue_refuses_the_newcomer_without_priority():
    engine, runner = make_engine(max_queued_requests=2)
    for rid in "abcd":
        add(engine, rid, n=2)
    run = Run(engine, runner).drain()
    # All four arrive before the first step: the queue holds a and b, c and d are refused.
    for rid in "cd":
        r = run.finished[rid].finish_reason
        assert (r.status_code, r.message) == (503, QUEUE_FULL_MESSAGE)
    assert {run.finished[rid].finish_reason.type for rid in "ab"} == {"length"}
    assert engine.get_load()["num_queue_full_refused_reqs"] == 2


def test_full_queue_evicts_the_least_preferred_newest_for_a_better_newcomer():
    engine, runner = make_engine(**PRIO, disable_priority_preemption=True,
                                 max_queued_requests=3)
    for rid, prio in [("x", 1), ("y", 0), ("z", 0)]:
        add(engine, rid, priority=prio, n=2)
    add(engine, "equal", priority=0, n=2)   # not strictly better than z: refused
    add(engine, "better", priority=2, n=2)  # evicts z (priority 0, the newest of the two)
    run = Run(engine, runner).drain()
    outcome = {rid: (o.finish_reason.status_code, o.finish_reason.message)
               for rid, o in run.finished.items() if o.finish_reason.type == "abort"}
    assert outcome == {"equal": (503, QUEUE_FULL_MESSAGE), "z": (503, EVICTED_MESSAGE)}
    assert run.started == ["better", "x", "y"]
    load = engine.get_load()
    assert (load["num_queue_full_refused_reqs"], load["num_queue_full_evicted_reqs"]) == (1, 1)


def test_queue_limit_is_not_applied_on_pd_servers():
    side = PrioritySide(SimpleNamespace(
        config=cfg(max_queued_requests=1, disaggregation_mode="prefill")))
    assert side.limit is None


# ---------------------------------------------------------------- randomised
arrivals = st.lists(st.tuples(st.integers(0, 12), st.sampled_from([None, -30, -5, 0, 4, 25]),
                              st.integers(1, 24), st.integers(1, 24)), min_size=2, max_size=9)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(arrivals=arrivals, threshold=st.sampled_from([0, 2, 10]), low_first=st.booleans(),
       preempt=st.booleans(), max_running=st.sampled_from([1, 2, 3]),
       pool=st.integers(40, 160), page_size=st.sampled_from([1, 4]),
       queue=st.sampled_from([None, None, 2]))
def test_random_arrivals_drain_with_exact_outputs(arrivals, threshold, low_first, preempt,
                                                  max_running, pool, page_size, queue):
    """Requests arrive over time with mixed priorities: every step keeps every invariant
    (KVSTRATA_CHECK_INTEGRITY), the engine drains within a step bound, a request ends with
    exactly its reference tokens unless a full queue refused it or it cannot fit alone, and
    the pools are whole afterwards."""
    runner = FakeRunner(page_size=page_size, vocab_size=VOCAB)
    engine = EngineCore(runner, SchedulerConfig(
        num_pages=pool // page_size, page_size=page_size, max_running_requests=max_running,
        enable_priority_scheduling=True, disable_priority_preemption=not preempt,
        priority_scheduling_preemption_threshold=threshold,
        schedule_low_priority_values_first=low_first, max_queued_requests=queue))
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    run, wanted, step = Run(engine, runner), {}, 0
    bound = 100 + 4 * sum(n + m for _, _, n, m in arrivals)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prio, n, max_new) = pending.pop(0)
            wanted[f"r{i}"] = (prompt(i, n), max_new)
            engine.add_request(EngineRequest(f"r{i}", prompt(i, n), SamplingParams(
                max_new_tokens=max_new, temperature=0, ignore_eos=True), priority=prio))
        run.step()
        step += 1
        assert step < bound, engine.dump_state()
    event(f"preempted > 0: {engine.get_load()['num_preempted_reqs'] > 0}")
    for rid, (ids, max_new) in wanted.items():
        reason = run.finished[rid].finish_reason
        if reason.type == "length":
            assert run.tokens[rid] == reference_tokens(ids, max_new, VOCAB), rid
        elif reason.message not in (QUEUE_FULL_MESSAGE, EVICTED_MESSAGE):
            need = -(-(len(ids) + max_new - 1) // page_size) * page_size
            assert need > engine.scheduler.kv.total_tokens, (rid, reason)
    engine.check_integrity()
    kv = engine.scheduler.kv
    assert kv.tree.protected_pages() == 0
    assert kv.allocator.available_pages() + kv.tree.cached_pages() == kv.allocator.num_pages


# ---------------------------------------------------------------- PD queues
@pytest.mark.parametrize("low_first", [False, True])
def test_pd_servers_admit_in_priority_order(low_first):
    """One row on each server: the prefill server admits its bootstrapped requests and the
    decode server its transferred ones by priority, so decode finishes in priority order."""
    from tests.unit.pd_fake import PDPair

    prio = {**PRIO, "schedule_low_priority_values_first": low_first}
    pair = PDPair(prefill_cfg={**prio, "max_running_requests": 1},
                  decode_cfg={**prio, "max_running_requests": 1,
                              "disaggregation_decode_extra_slots": 0})
    pair.submit("first", prompt(1), 12, priority=0)
    for _ in range(4):
        pair.step()  # "first" holds the decode row
    for rid, p in [("a", 1), ("b", 7), ("c", -4)]:
        pair.submit(rid, prompt(len(rid) + ord(rid)), 3, priority=p)
    pair.run()
    order = [rid for rid in pair.finished["decode"] if rid != "first"]
    assert order == (["c", "a", "b"] if low_first else ["b", "a", "c"])
    assert all(r.type == "length" for r in pair.finished["decode"].values())


def test_pd_decode_preempts_by_backing_up_and_restores_exactly():
    """One decode row: a transferred high-priority request takes the row of a long low one,
    which is backed up (a decode server cannot recompute its prompt), restored later and
    still produces exactly its reference tokens."""
    from kvstrata.engine.sides.registry import pd_side
    from tests.unit.pd_fake import PDPair

    pair = PDPair(prefill_cfg=PRIO, decode_cfg={**PRIO, "max_running_requests": 1,
                                                "disaggregation_decode_extra_slots": 2})
    pair.submit("low", prompt(1), 30, priority=0)
    for _ in range(6):
        pair.step()
    pair.submit("high", prompt(2), 4, priority=50)
    pair.run()
    assert list(pair.finished["decode"]) == ["high", "low"]
    for rid, seed, n in [("low", 1, 30), ("high", 2, 4)]:
        assert pair.outputs["decode"][rid] == reference_tokens(prompt(seed), n, VOCAB), rid
    retraction = pd_side(pair.decode.scheduler).retraction
    assert retraction.num_preempted == 1 and retraction.num_backups["cpu_tensor"] == 1
    assert retraction.num_restores["cpu_tensor"] == 1


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(arrivals=arrivals, threshold=st.sampled_from([0, 2, 10]), low_first=st.booleans(),
       rows=st.sampled_from([1, 2]), extra=st.sampled_from([1, 3]),
       decode_pool=st.integers(40, 200), backup=st.sampled_from(["cpu_tensor", "host_pool"]))
def test_pd_random_arrivals_with_decode_preemption(arrivals, threshold, low_first, rows, extra,
                                                   decode_pool, backup):
    """The same over a PD pair: a decode server with few rows preempts by backing requests
    up (and may also retract them for memory); every request ends with its reference tokens
    unless it cannot fit, and both servers drain whole."""
    from kvstrata.engine.sides.registry import pd_side
    from tests.unit.pd_fake import PDPair

    prio = {**PRIO, "priority_scheduling_preemption_threshold": threshold,
            "schedule_low_priority_values_first": low_first}
    pair = PDPair(prefill_cfg=prio, decode_pages=decode_pool, decode_cfg={
        **prio, "max_running_requests": rows, "disaggregation_decode_extra_slots": extra,
        "disaggregation_decode_retraction_backup": backup,
        "num_host_pages": 64 if backup == "host_pool" else 0})
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    wanted, step = {}, 0
    bound = 300 + 6 * sum(n + m for _, _, n, m in arrivals)
    while pending or pair.busy():
        while pending and pending[0][1][0] <= step:
            i, (_, p, n, max_new) = pending.pop(0)
            wanted[f"r{i}"] = (prompt(i, n), max_new)
            pair.submit(f"r{i}", prompt(i, n), max_new, priority=p, ignore_eos=True)
        pair.step()
        step += 1
        assert step < bound, pair.decode.dump_state()
    pair.check_drained()
    event(f"decode preemptions > 0: {pd_side(pair.decode.scheduler).retraction.num_preempted > 0}")
    for rid, (ids, max_new) in wanted.items():
        reason = pair.finished["decode"][rid]
        if reason.type == "length":
            assert pair.outputs["decode"][rid] == reference_tokens(ids, max_new, VOCAB), rid
        else:
            assert reason.status_code in (400, 500), (rid, reason)  # cannot fit / pool full


def test_preemption_never_empties_the_batch_without_admitting_the_newcomer():
    """The scheduler fuzz's case: a 16-token pool, one row; a request that needs the whole
    pool (1 prompt token + 16 new) arrives while a low-priority one runs. SGLang's arithmetic
    alone preempted the runner and then could not admit the newcomer (the decode reserve of
    a full pool), and the stalled round aborted it. Now it is admitted and both finish."""
    engine, runner = make_engine(num_pages=16, **PRIO,
                                 priority_scheduling_preemption_threshold=0)
    engine.add_request(EngineRequest("low", prompt(1, 1), SamplingParams(
        max_new_tokens=2, temperature=0, ignore_eos=True), priority=-12))
    run = Run(engine, runner)
    run.step()
    engine.add_request(EngineRequest("big", prompt(2, 1), SamplingParams(
        max_new_tokens=16, temperature=0, ignore_eos=True), priority=15))
    run.drain()
    assert {rid: o.finish_reason.type for rid, o in run.finished.items()} == {
        "low": "length", "big": "length"}
    assert run.tokens["big"] == reference_tokens(prompt(2, 1), 16, VOCAB)
    assert run.tokens["low"] == reference_tokens(prompt(1, 1), 2, VOCAB)
