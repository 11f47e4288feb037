"""HiCache L2 bookkeeping without torch: a device pool far smaller than a multi-turn working
set spills pages to the host tier and loads them back; the fake runner moves the fake KV, so
a wrong page id or a missed copy changes the outputs."""
from __future__ import annotations

import pytest

from kvstrata.cache.hiradix_cache import WRITE_POLICIES
from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.request import EngineRequest
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.protocol import SamplingParams
from tests.unit.fake_runner import FakeRunner, reference_tokens

VOCAB = 1000


def multi_turn(engine, conversations=3, turns=5, system_len=24, user_len=6, answer=5):
    """Shared system prompt, several conversations, several turns; each turn's prompt is the
    whole history. Returns {(conv, turn): tokens}."""
    system = [(7 * i + 3) % VOCAB for i in range(system_len)]
    history = {c: list(system) for c in range(conversations)}
    outputs = {}
    for t in range(turns):
        for c in range(conversations):
            history[c] += [(c * 97 + t * 31 + i * 13) % VOCAB for i in range(user_len)]
            rid = f"c{c}t{t}"
            engine.add_request(EngineRequest(rid, list(history[c]),
                                             SamplingParams(max_new_tokens=answer, temperature=0)))
            got = []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    got += out.new_token_ids
            assert got == reference_tokens(history[c], answer, VOCAB), rid
            outputs[(c, t)] = got
            history[c] += got
            engine.check_integrity()
    return outputs


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_starved_device_pool_loads_back(policy, page_size):
    runner = FakeRunner(page_size=page_size, vocab_size=VOCAB)
    engine = EngineCore(runner, SchedulerConfig(
        num_pages=96 // page_size, page_size=page_size, num_host_pages=1024 // page_size,
        hicache_write_policy=policy))
    multi_turn(engine)
    tree = engine.scheduler.kv.tree
    assert tree.stats.host_hit_tokens > 0, "nothing was loaded back"
    assert tree.stats.demoted_pages > 0 and runner.moved_pages["h2d"] > 0
    assert runner.moved_pages["d2h"] > 0
    engine.check_integrity()


def test_host_exhaustion_degrades_to_recompute():
    runner = FakeRunner(page_size=1, vocab_size=VOCAB)
    engine = EngineCore(runner, SchedulerConfig(num_pages=80, page_size=1, num_host_pages=16,
                                                hicache_write_policy="write_back"))
    multi_turn(engine)
    engine.check_integrity()
    assert engine.scheduler.kv.host_allocator.num_used() <= 16


def test_flush_frees_both_tiers():
    runner = FakeRunner(page_size=1, vocab_size=VOCAB)
    engine = EngineCore(runner, SchedulerConfig(num_pages=96, page_size=1, num_host_pages=512))
    multi_turn(engine, conversations=2, turns=2)
    assert engine.flush_cache()
    kv = engine.scheduler.kv
    assert kv.allocator.available_pages() == 96 and kv.host_allocator.available_pages() == 512


def test_decode_waits_for_a_write_through_copy_instead_of_aborting():
    """Found by test_scheduler_fuzz: three 16-token pages; r0 (15 tokens) finishes and its
    page is being written to the host (pinned by the copy job); r1 (32 + 2 tokens) needs a
    third page for its decode. It used to be aborted for OOM as the last running request;
    now decode waits for the copy, evicts r0's page and finishes."""
    runner = FakeRunner(page_size=16, vocab_size=VOCAB)
    engine = EngineCore(runner, SchedulerConfig(num_pages=3, page_size=16, num_host_pages=4,
                                                hicache_write_policy="write_through"))
    p0 = [(5 * i + 1) % VOCAB for i in range(15)]
    p1 = [(5 * i + 1) % VOCAB for i in range(30)] + [3, 3]
    for rid, p in (("r0", p0), ("r1", p1)):
        engine.add_request(EngineRequest(rid, p, SamplingParams(max_new_tokens=2, temperature=0,
                                                                ignore_eos=True)))
    got, reasons = {"r0": [], "r1": []}, {}
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            got[out.rid] += out.new_token_ids
            if out.finished:
                reasons[out.rid] = out.finish_reason.type
    assert reasons == {"r0": "length", "r1": "length"}
    assert got["r1"] == reference_tokens(p1, 2, VOCAB)
    engine.check_integrity()
