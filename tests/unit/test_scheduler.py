"""Scheduler scenarios without torch: exact page ids, chunking, prefix hits, retraction
order, new_token_ratio values. The fake runner verifies the KV through req_to_token."""
from __future__ import annotations

import logging

import pytest

from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.request import EngineRequest, Request
from kvstrata.engine.scheduler.core import OOM_LAST_REQUEST_MESSAGE, SchedulerConfig
from kvstrata.engine.scheduler.new_token_ratio import NewTokenRatio
from kvstrata.engine.scheduler.out_of_memory import retract_for_decode
from kvstrata.protocol import SamplingParams
from tests.unit.fake_runner import FakeRunner, reference_tokens

VOCAB = 1000


def make_engine(num_pages=256, page_size=1, **cfg):
    runner = FakeRunner(page_size=page_size, vocab_size=VOCAB)
    engine = EngineCore(runner, SchedulerConfig(num_pages=num_pages, page_size=page_size, **cfg))
    return engine, runner


def run_all(engine, requests, max_steps=10_000):
    for rid, prompt, n in requests:
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0)))
    results = {rid: [] for rid, _, _ in requests}
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            results[out.rid].extend(out.new_token_ids)
            if out.finished:
                finished[out.rid] = out
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    return results, finished


def prompt(seed, n):
    return [(seed * 131 + i * 17) % VOCAB for i in range(n)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_single_request_exact_pages_and_output(page_size):
    engine, runner = make_engine(num_pages=64, page_size=page_size)
    p = prompt(1, 10)
    results, finished = run_all(engine, [("a", p, 6)])
    assert results["a"] == reference_tokens(p, 6, VOCAB)
    assert finished["a"].finish_reason.type == "length"
    first = runner.steps[0].scheduled[0]
    # Lowest page ids first; page 0 never used.
    expected_pages = list(range(1, -(-10 // page_size) + 1))
    assert sorted({s // page_size for s in first.slots}) == expected_pages
    assert first.start_pos == 0 and first.token_ids == p and first.sample
    # Computed tokens: prompt + 5 decoded (the last sampled token is never fed back).
    kv = engine.scheduler.kv
    assert kv.tree.cached_pages() == 15 // page_size
    assert kv.allocator.available_pages() == 64 - 15 // page_size


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_hit_and_full_prompt_hit(page_size):
    engine, runner = make_engine(page_size=page_size)
    shared = prompt(2, 12)
    run_all(engine, [("a", shared + [5, 6, 7], 4)])
    _, fin = run_all(engine, [("b", shared + [9, 9], 4)])
    assert fin["b"].cached_tokens == 12 // page_size * page_size
    # Same prompt again: everything but the last prompt token may be reused.
    again = shared + [5, 6, 7]
    res, fin = run_all(engine, [("c", again, 4)])
    assert fin["c"].cached_tokens == (len(again) - 1) // page_size * page_size
    assert res["c"] == reference_tokens(again, 4, VOCAB)
    last = runner.steps[-4].scheduled[0]  # c's prefill
    assert last.start_pos == fin["c"].cached_tokens


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_salt_shares_prefixes_only_within_a_salt(page_size):
    """SGLang's extra_key / cache_salt: a prompt cached under one salt is a miss under
    another and without one, a hit under the same salt; outputs are the same everywhere."""
    engine, _ = make_engine(page_size=page_size)
    p = prompt(4, 13)
    want = reference_tokens(p, 3, VOCAB)

    def run(rid, salt):
        engine.add_request(EngineRequest(rid, p, SamplingParams(max_new_tokens=3,
                                                                temperature=0),
                                         cache_salt=salt))
        out, fin = [], None
        while engine.has_unfinished_requests():
            for o in engine.step():
                out += o.new_token_ids
                fin = o if o.finished else fin
        engine.check_integrity()
        assert out == want
        return fin.cached_tokens

    hit = 12 // page_size * page_size
    assert run("a", "tenant-1") == 0
    assert run("b", "tenant-2") == 0
    assert run("c", None) == 0
    assert run("d", "") == hit  # an empty salt is no salt (SGLang), as "c"
    assert run("e", "tenant-1") == hit
    assert run("f", "tenant-2") == hit
    kv = engine.scheduler.kv
    assert kv.peek_prefix_len(p, salt="tenant-1") == hit
    assert kv.peek_prefix_len(p, salt="tenant-3") == 0


def test_disable_radix_cache_frees_everything():
    engine, _ = make_engine(num_pages=64, disable_radix_cache=True)
    p = prompt(3, 8)
    run_all(engine, [("a", p, 3)])
    _, fin = run_all(engine, [("b", p, 3)])
    assert fin["b"].cached_tokens == 0
    assert engine.scheduler.kv.allocator.available_pages() == 64


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_chunks_and_output(page_size):
    engine, runner = make_engine(page_size=page_size, chunked_prefill_size=8)
    p = prompt(4, 21)
    res, _ = run_all(engine, [("a", p, 5)])
    assert res["a"] == reference_tokens(p, 5, VOCAB)
    prefill = [s.scheduled[0] for s in runner.steps if s.is_prefill]
    assert [len(s.token_ids) for s in prefill] == [8, 8, 5]
    assert [s.sample for s in prefill] == [False, False, True]
    assert [s.start_pos for s in prefill] == [0, 8, 16]


def test_batch_outputs_equal_alone():
    reqs = [(f"r{i}", prompt(10 + i, 3 + 7 * i), 8 + i) for i in range(8)]
    engine, runner = make_engine(page_size=4, chunked_prefill_size=16)
    res, _ = run_all(engine, reqs)
    for rid, p, n in reqs:
        assert res[rid] == reference_tokens(p, n, VOCAB), rid
    assert max(len(s.scheduled) for s in runner.steps) > 1  # really batched


def test_max_running_requests_bounds_batch():
    reqs = [(f"r{i}", prompt(i, 5), 4) for i in range(6)]
    engine, runner = make_engine(max_running_requests=2)
    run_all(engine, reqs)
    assert max(len(s.scheduled) for s in runner.steps) <= 2


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_keeps_outputs_exact(page_size, caplog):
    # 48 token pool, 6 requests each needing 8 + 16 tokens: the batch cannot all fit.
    reqs = [(f"r{i}", prompt(20 + i, 8), 16) for i in range(6)]
    engine, runner = make_engine(num_pages=48 // page_size, page_size=page_size,
                                 schedule_conservativeness=0.05)
    with caplog.at_level(logging.WARNING):
        res, fin = run_all(engine, reqs)
    assert engine.scheduler.num_retractions > 0
    assert "KV cache pool is full. Retract requests. #retracted_reqs:" in caplog.text
    for rid, p, n in reqs:
        assert res[rid] == reference_tokens(p, n, VOCAB), rid
        assert fin[rid].finish_reason.type == "length"


def test_retraction_order_and_ratio():
    engine, _ = make_engine(num_pages=60, schedule_conservativeness=0.01)
    sched = engine.scheduler
    # Three running requests with different progress: craft state by running prefills.
    for rid, plen in (("short", 4), ("long", 9), ("mid", 6)):
        engine.add_request(EngineRequest(rid, prompt(len(rid), plen),
                                         SamplingParams(max_new_tokens=30, temperature=0)))
    for _ in range(10):
        if len(sched.running) == 3:
            break
        engine.step()
    assert len(sched.running) == 3
    engine.step()  # one decode step: everyone has >= 1 output
    by = {r.rid: r for r in sched.running}
    free = sched.kv.allocator.available_pages()
    # Fill the pool so the next decode cannot get pages.
    hog = sched.kv.allocator.alloc(free)
    retract_for_decode(sched)
    assert [r.rid for r in sched.waiting][0] == "long"  # all tied on outputs: longest prompt first
    # Fewest generated tokens first (ties: longest prompt); the last one is never retracted.
    order = sorted(by.values(), key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
    retracted = [r.rid for r in sched.waiting]
    assert retracted == [r.rid for r in order[:len(retracted)]] and 1 <= len(retracted) <= 2
    remaining = sched.running
    gen = sum(len(r.output_ids) for r in remaining)
    expected = min(1.0, (gen + 20 * len(remaining)) / (30 * len(remaining) + 1))
    assert sched.ratio.value == pytest.approx(expected)
    sched.kv.allocator.free(hog)
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    engine.check_integrity()


def test_last_request_aborted_when_alone_out_of_memory():
    engine, _ = make_engine(num_pages=12)
    res, fin = run_all(engine, [("a", prompt(5, 6), 100)])
    assert fin["a"].finish_reason.type == "abort"
    assert fin["a"].finish_reason.message == OOM_LAST_REQUEST_MESSAGE
    assert fin["a"].finish_reason.status_code == 500
    assert len(res["a"]) == 12 - 6 + 1


def test_new_token_ratio_schedule():
    r = NewTokenRatio(1.0)
    assert r.value == pytest.approx(0.7)
    for _ in range(300):
        r.on_decode_step()
    assert r.value == pytest.approx(0.7 - 300 * (0.7 - 0.098) / 600)
    for _ in range(400):
        r.on_decode_step()
    assert r.value == pytest.approx(0.098)
    assert NewTokenRatio(2.0).value == 1.0


def test_lpm_prefers_longest_prefix():
    engine, runner = make_engine(schedule_policy="lpm", max_running_requests=1)
    shared = prompt(7, 10)
    run_all(engine, [("warm", shared + [1], 1)])
    for rid, p in (("cold", prompt(8, 11)), ("hot", shared + [2])):
        engine.add_request(EngineRequest(rid, p, SamplingParams(max_new_tokens=1, temperature=0)))
    first = engine.step()
    assert [o.rid for o in first] == ["hot"]


def test_bad_requests_rejected_not_raised():
    engine, _ = make_engine(num_pages=32)
    engine.add_request(EngineRequest("empty", [], SamplingParams()))
    engine.add_request(EngineRequest("huge", list(range(40)), SamplingParams()))
    engine.add_request(EngineRequest("oov", [VOCAB + 5], SamplingParams()))
    outs = {o.rid: o for o in engine.step()}
    assert set(outs) == {"empty", "huge", "oov"}
    assert all(o.finished and o.finish_reason.status_code == 400 for o in outs.values())
    engine.check_integrity()


def test_abort_waiting_and_running_frees_pages():
    engine, _ = make_engine(num_pages=64, page_size=4)
    for i in range(3):
        engine.add_request(EngineRequest(f"r{i}", prompt(i, 9),
                                         SamplingParams(max_new_tokens=50, temperature=0)))
    engine.step()
    engine.step()
    engine.abort_request("r0")
    engine.abort_request("r2")
    outs = {o.rid: o for o in engine.step()}
    assert outs["r0"].finish_reason.type == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.flush_cache()
    assert engine.scheduler.kv.allocator.available_pages() == 64


def test_stream_interval_batches_deltas():
    engine, _ = make_engine()
    engine.stream_interval = 4
    p = prompt(9, 5)
    engine.add_request(EngineRequest("a", p, SamplingParams(max_new_tokens=10, temperature=0)))
    sizes = []
    while engine.has_unfinished_requests():
        sizes += [len(o.new_token_ids) for o in engine.step() if o.new_token_ids]
    assert sizes == [1, 4, 4, 1]  # first token at once, then every 4, the rest at finish
    # SGLang's per-request sampling_params.stream_interval overrides the server's
    sizes = {"b": [], "c": []}
    engine.add_request(EngineRequest("b", p, SamplingParams(max_new_tokens=10, temperature=0,
                                                            stream_interval=3)))
    engine.add_request(EngineRequest("c", p, SamplingParams(max_new_tokens=10, temperature=0,
                                                            stream_interval=1)))
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.new_token_ids:
                sizes[o.rid].append(len(o.new_token_ids))
    assert sizes == {"b": [1, 3, 3, 3], "c": [1] * 10}


def test_stall_aborts_the_request_that_cannot_fit_alone(caplog):
    # The scheduler on its own (no EngineCore input check): a prompt larger than the pool
    # can never be admitted. The step must not spin: it logs the state once and aborts it.
    engine, runner = make_engine(num_pages=8, page_size=1, chunked_prefill_size=4)
    sched = engine.scheduler
    big = Request("big", prompt(5, 12), SamplingParams(max_new_tokens=2, temperature=0), 0)
    small = Request("small", prompt(6, 3), SamplingParams(max_new_tokens=2, temperature=0), 1)
    sched.add(big)
    sched.add(small)
    with caplog.at_level(logging.WARNING):
        out = engine.step()
    assert [o.rid for o in out] == ["big"] and out[0].finish_reason.status_code == 400
    assert "needs about 13 KV tokens but the pool holds 8" in out[0].finish_reason.message
    assert sched.num_stalls == 1 and caplog.text.count("Scheduler made no progress") == 1
    assert "waiting: big(prompt=12" in caplog.text  # the state dump
    res = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            res.setdefault(o.rid, []).extend(o.new_token_ids)
    assert res["small"] == reference_tokens(small.prompt_ids, 2, VOCAB)
    assert sched.num_stalls == 1
    engine.check_integrity()


def test_scheduler_config_defaults_are_server_args_defaults():
    """Every policy default has one home: ServerArgs (speculative_num_draft_tokens, which
    ServerArgs leaves to resolution, takes NGRAM's resolved default, the max match window)."""
    import dataclasses

    from kvstrata.config.server_args import ServerArgs

    server = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    for f in dataclasses.fields(SchedulerConfig):
        if f.name == "plan":
            continue
        want = server["speculative_ngram_max_match_window_size"] \
            if f.name == "speculative_num_draft_tokens" else server[f.name]
        assert f.default == want, f.name
