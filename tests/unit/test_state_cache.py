"""Recurrent state, the bookkeeping (no torch): the snapshot radix tree (cache/state_radix.py),
the request-facing slots (cache/state_slots.py) and the scheduler's state fields, against the
fake state runner (tests/unit/fake_state_runner.py), which fails any forward that starts from
a state other than the one its tokens make."""
from __future__ import annotations

import pytest

from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.state_radix import StateRadixCache
from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.request import EngineRequest
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.protocol import SamplingParams
from tests.unit.fake_runner import reference_tokens
from tests.unit.fake_state_runner import FakeStateRunner

VOCAB = 97


# ---- the tree -------------------------------------------------------------------------------
def make_tree(page_size=1, pages=64, slots=8):
    alloc, states = PageAllocator(pages, page_size), PageAllocator(slots, 1)
    return StateRadixCache(alloc, page_size, states), alloc, states


def cache(tree, ids, snapshot=True):
    """Insert `ids` with fresh pages (duplicates freed) and file a snapshot at their end."""
    P = tree.page_size
    pages = tree.allocator.alloc(len(ids) // P)
    had = tree.insert(ids, pages)
    tree.allocator.free(pages[:had])
    if snapshot:
        slot = tree.slots.alloc(1)[0]
        assert tree.attach_state(tree.node_at(ids), slot)
        return slot
    return 0


def test_a_match_ends_at_the_last_snapshot_and_splits_leave_tombstones():
    tree, _, _ = make_tree()
    a = list(range(1, 9))
    cache(tree, a)
    b = a[:4] + [20, 21, 22, 23]  # branches inside a's node: [1..4] becomes a tombstone
    cache(tree, b)
    assert tree.peek_device_pages(a + [50]) == 8 and tree.peek_device_pages(b) == 8
    assert tree.peek_device_pages(a[:4] + [30, 31]) == 0  # K/V cached, no state at 4
    assert tree.peek_kv_pages(a[:4] + [30, 31]) == 4
    match = tree.match_prefix(a[:6] + [30])  # ends inside a's lower half: back to nothing
    assert match.last_node is tree.root and tree.total_state_cut_tokens == 6
    slot = cache(tree, a[:4], snapshot=True)  # the branch point gets a snapshot
    match = tree.match_prefix(a[:4] + [30])
    assert len(match.device_pages) == 4 and match.last_node.state_slot == slot
    assert not tree.attach_state(match.last_node, 99)  # it has one: the caller's goes
    tree.check_integrity()


def test_state_eviction_tombstones_inner_nodes_and_drops_unlocked_leaves():
    tree, alloc, slots = make_tree(slots=4)
    a = list(range(1, 9))
    s_inner = cache(tree, a[:4])
    s_leaf = cache(tree, a)
    assert tree.evict_states(1) == 1  # LRU: the inner node (older stamp) loses its state only
    assert not tree.node_at(a[:4]).state_slot and tree.cached_pages() == 8
    assert slots.available_pages() == 3 and s_inner and s_leaf
    # an unlocked leaf goes with its K/V, then its snapshot-less parent (a useless leaf)
    assert tree.evict_states(1) == 1
    assert tree.cached_pages() == 0 and alloc.available_pages() == 64
    assert slots.available_pages() == 4
    tree.check_integrity()


def test_pinned_snapshots_stay_and_locked_leaves_keep_their_pages():
    tree, _, _ = make_tree()
    a, b = list(range(1, 7)), list(range(30, 36))
    cache(tree, a)
    cache(tree, b)
    pinned = tree.match_prefix(a + [9]).last_node
    tree.lock(pinned)
    tree.pin_state(pinned)
    locked = tree.match_prefix(b + [9]).last_node
    tree.lock(locked)
    assert tree.evict_states(10) == 1  # b's only: a is pinned
    assert pinned.state_slot and not locked.state_slot and locked.parent is tree.root
    assert tree.cached_pages() == 12
    with pytest.raises(ValueError, match="unlock of an unlocked"):
        tree.unlock(pinned) or tree.unlock(pinned)
    tree.lock(pinned)
    tree.unpin_state(pinned)
    tree.check_integrity()


def test_kv_eviction_frees_snapshots_and_takes_snapshotless_leaves_first():
    tree, alloc, slots = make_tree()
    cache(tree, list(range(1, 5)))                     # older, with a snapshot
    cache(tree, list(range(40, 44)), snapshot=False)   # newer, none: no match can end there
    tree.evict(4)
    assert tree.peek_kv_pages(list(range(40, 44))) == 0
    assert tree.peek_device_pages(list(range(1, 5)) + [9]) == 4
    tree.evict(4)
    assert slots.available_pages() == 8 and alloc.available_pages() == 64
    tree.check_integrity()


def test_integrity_check_catches_a_slot_owned_twice():
    tree, _, slots = make_tree()
    slot = cache(tree, [1, 2, 3])
    tree.node_at([1, 2]).state_slot = slot  # the split upper half claims it too
    tree._num_states += 1
    with pytest.raises(AssertionError, match="kept by two nodes"):
        tree.check_integrity()


# ---- the scheduler and the fake state runner ----------------------------------------------
def make_engine(page_size=1, slots=16, pages=256, **kw):
    runner = FakeStateRunner(page_size=page_size, vocab_size=VOCAB)
    cfg = SchedulerConfig(num_pages=pages // page_size, page_size=page_size,
                          num_state_slots=slots, **{"max_running_requests": 4, **kw})
    return EngineCore(runner, cfg), runner


def run(engine, prompts: dict, max_new=3, steps=400):
    outs = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, SamplingParams(
            max_new_tokens=max_new, temperature=0, ignore_eos=True)))
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outs[out.rid] += out.new_token_ids
    for rid, ids in prompts.items():
        assert outs[rid] == reference_tokens(ids, max_new, VOCAB), rid
    kv = engine.scheduler.kv
    engine.check_integrity()
    assert kv.states.allocator.available_pages() + kv.tree.cached_states() == kv.states.num_slots
    return outs


def entries(runner, rid):
    return [s for so in runner.steps for s in so.scheduled if s.rid == rid]


def test_finish_donates_the_state_and_a_follow_up_copies_it():
    engine, runner = make_engine()
    prompt = list(range(3, 13))
    out = run(engine, {"a": prompt})["a"]
    first = entries(runner, "a")
    assert first[0].state_reset and first[0].state_slot == 1
    assert all(e.state_slot == 1 and not e.state_snapshot_to for e in first)
    node = engine.scheduler.kv.tree.node_at(prompt + out[:-1])
    assert node.state_slot == 1  # the state after prompt + output[:-1], donated
    follow = prompt + out + [5, 6]
    run(engine, {"b": follow})
    b = entries(runner, "b")[0]
    assert (b.start_pos, b.state_copy_from, b.state_reset) == (12, 1, False)
    assert b.state_slot != 1 and runner.copies == 1


def test_chunked_prefill_keeps_its_slot_and_snapshots_each_chunk_end():
    engine, runner = make_engine(chunked_prefill_size=4)
    prompt = list(range(3, 13))
    run(engine, {"a": prompt}, max_new=1)
    es = entries(runner, "a")
    assert [(e.start_pos, len(e.token_ids)) for e in es] == [(0, 4), (4, 4), (8, 2)]
    assert len({e.state_slot for e in es}) == 1 and es[0].state_reset
    assert [bool(e.state_snapshot_to) for e in es] == [True, True, False]
    tree = engine.scheduler.kv.tree
    assert tree.peek_device_pages(prompt[:4] + [1]) == 4
    assert tree.peek_device_pages(prompt[:8] + [1]) == 8
    assert tree.peek_device_pages(prompt + [1]) == 10  # the finish's (working slot)


def test_extra_buffer_leaves_its_last_track_point_at_an_unaligned_end():
    engine, runner = make_engine(page_size=4, mamba_track_interval=4)
    prompt = list(range(3, 13))  # 10 tokens; 8 new: computed end 17, not page-aligned
    out = run(engine, {"a": prompt}, max_new=8)["a"]
    tracked = [e.state_snapshot_at or e.start_pos + len(e.token_ids)
               for e in entries(runner, "a") if e.state_snapshot_to]
    # the prompt's last track point (inside its one prefill forward), then the decode
    # steps that end on one
    assert tracked == [8, 12, 16]
    tree = engine.scheduler.kv.tree
    seq = prompt + out
    assert tree.peek_device_pages(seq) == 4 and tree.peek_kv_pages(seq) == 4  # 16 tokens
    run(engine, {"b": seq + [7]})
    b = entries(runner, "b")[0]
    assert b.start_pos == 16 and b.state_copy_from


def test_a_branch_point_is_snapshotted_for_the_next_request_of_that_prefix():
    engine, runner = make_engine()
    shared = list(range(3, 15))
    run(engine, {"a": shared + [60, 61, 62]})
    run(engine, {"b": shared + [70, 71]})  # K/V cached to 12, no state there
    b = entries(runner, "b")
    assert (b[0].start_pos, len(b[0].token_ids), b[0].state_reset) == (0, 12, True)
    assert b[0].state_snapshot_to and b[1].start_pos == 12
    run(engine, {"c": shared + [80, 81]})
    c = entries(runner, "c")[0]
    assert c.start_pos == 12 and c.state_copy_from == b[0].state_snapshot_to


def test_admission_waits_for_a_free_slot():
    engine, runner = make_engine(slots=1)
    run(engine, {"a": [5, 6, 7], "b": [8, 9, 10]})
    a, b = entries(runner, "a"), entries(runner, "b")
    assert runner.steps.index(next(so for so in runner.steps if so.scheduled[0].rid == "b")) \
        > max(i for i, so in enumerate(runner.steps) for s in so.scheduled if s.rid == "a")
    assert a[0].state_slot == b[0].state_slot == 1  # b's took a's donated snapshot's slot


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_and_aborts_leave_no_slot_behind(page_size):
    # a pool so small that decode retracts; then a client abort mid-prefill
    engine, runner = make_engine(page_size=page_size, pages=48, chunked_prefill_size=8,
                                 mamba_track_interval=4 * page_size,
                                 schedule_conservativeness=0.05)
    prompts = {f"r{i}": [(7 * i + j) % 90 + 3 for j in range(10 + i)] for i in range(4)}
    run(engine, prompts, max_new=12)
    assert engine.scheduler.num_retractions > 0
    engine.add_request(EngineRequest("x", list(range(3, 40)), SamplingParams(
        max_new_tokens=4, temperature=0, ignore_eos=True)))
    engine.step()
    assert engine.scheduler.chunked_req is not None
    engine.abort_request("x")
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.scheduler.kv
    engine.check_integrity()
    assert kv.states.allocator.available_pages() + kv.tree.cached_states() == kv.states.num_slots


def test_a_leaked_slot_fails_the_integrity_check():
    engine, _ = make_engine()
    run(engine, {"a": [5, 6, 7]})
    engine.scheduler.kv.states.allocator.alloc(1)  # nobody owns it
    with pytest.raises(AssertionError, match="state slot leak"):
        engine.check_integrity()


# ---- the hit rate on a multi-turn chat (vLLM's 0%-hit trap) --------------------------------
def chat_hit_rate(page_size, state, interval=None, conversations=6, turns=5, max_new=20,
                  pool_tokens=4096, host=None):
    """Conversations whose every turn sends the whole history (each answer) plus a new
    user message, as chat clients do; two conversations run at a time. The prefix-cache hit
    rate (matched / queried prompt tokens). `host`: (host pages, host state slots) of a
    HiCache tier (test_state_hicache.py)."""
    runner_cls = FakeStateRunner if state else None
    kw = dict(num_state_slots=48, mamba_track_interval=interval) if state else {}
    if host is not None:
        kw.update(num_host_pages=host[0], num_host_state_slots=host[1])
    from tests.unit.fake_runner import FakeRunner  # noqa: PLC0415
    runner = (runner_cls or FakeRunner)(page_size=page_size, vocab_size=VOCAB)
    engine = EngineCore(runner, SchedulerConfig(num_pages=pool_tokens // page_size,
                                                page_size=page_size, max_running_requests=8,
                                                **kw))
    history = {c: [(11 * c + j) % 90 + 3 for j in range(24)] for c in range(conversations)}
    for turn in range(turns):
        for pair in range(0, conversations, 2):
            prompts = {f"c{c}t{turn}": history[c] for c in (pair, pair + 1)}
            outs = run(engine, prompts, max_new=max_new) if state else \
                _run_plain(engine, prompts, max_new)
            for c in (pair, pair + 1):
                history[c] = history[c] + outs[f"c{c}t{turn}"] + [
                    (5 * c + turn * 3 + j) % 90 + 3 for j in range(12)]
    return engine.scheduler.kv.hit_rate()


def _run_plain(engine, prompts, max_new):
    outs = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        engine.add_request(EngineRequest(rid, ids, SamplingParams(
            max_new_tokens=max_new, temperature=0, ignore_eos=True)))
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.rid] += out.new_token_ids
    return outs


@pytest.mark.parametrize("page_size, interval, share, max_new", [
    (1, None, 0.99, 20),   # no_buffer: every finish is a snapshot
    (16, None, 0.95, 20),  # extra_buffer tracking every page end: the last one before a finish
    # short answers whose decode crosses no page end: the snapshot at the prompt's last page
    # end, taken inside its prefill forward (0.0 without it)
    (16, None, 0.95, 4),
])
def test_multi_turn_chat_hits_nearly_as_often_as_without_state(page_size, interval, share,
                                                               max_new):
    plain = chat_hit_rate(page_size, state=False, max_new=max_new)
    got = chat_hit_rate(page_size, state=True, interval=interval, max_new=max_new)
    assert plain > 0.5 and got >= share * plain, (got, plain)


def test_load_and_metrics_report_state_slots():
    from kvstrata.metrics import ServerMetrics  # noqa: PLC0415

    engine, _ = make_engine(slots=6)
    engine.add_request(EngineRequest("a", [5, 6, 7, 8], SamplingParams(
        max_new_tokens=4, temperature=0, ignore_eos=True)))
    engine.step()
    load = engine.get_load()
    assert (load["num_used_state_slots"], load["max_state_slots"]) == (1, 6)
    m = ServerMetrics("tiny")
    m.set_load(load)
    assert 'kvstrata:state_slot_usage{model_name="tiny"} ' + str(1 / 6) in m.render().decode()
    while engine.has_unfinished_requests():
        engine.step()
    load = engine.get_load()
    assert load["num_used_state_slots"] == 0 and load["num_cached_states"] == 1


def test_a_one_slot_pool_resumes_from_its_snapshot_by_taking_it_over():
    """Found by test_state_fuzz: one slot, held by the snapshot a request matches. Copying
    needs a second slot, so the request takes that one over (no copy, no reset)."""
    engine, runner = make_engine(slots=1)
    out = run(engine, {"a": [5, 6, 7]})["a"]
    prompt_b = [5, 6, 7] + out + [9]
    out_b = run(engine, {"b": prompt_b})["b"]
    b = entries(runner, "b")[0]
    assert (b.start_pos, b.state_slot, b.state_copy_from, b.state_reset) == (5, 1, 0, False)
    tree = engine.scheduler.kv.tree
    assert tree.node_at([5, 6, 7, *out[:-1]]).state_slot == 0  # taken over: a tombstone
    assert tree.node_at(prompt_b + out_b[:-1]).state_slot == 1  # b's finish left it
