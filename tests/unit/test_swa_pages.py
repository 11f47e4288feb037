"""Hybrid SWA memory without torch: the SWA page map, swa_slots, out-of-window release,
SWA-aware matching, last-window locks, SWA eviction and insert healing, integrity, and the
capacity it buys (cache/swa_pages.py, cache/swa_radix.py, the scheduler's use of them)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvstrata.cache.invariants import check_kv_state
from kvstrata.cache.kv_manager import KVManager
from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.swa_pages import SWAPages
from kvstrata.cache.swa_hiradix import SWAHiRadixCache
from kvstrata.cache.swa_radix import SWARadixCache
from kvstrata.config.kv_plan import KVPlan
from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.request import EngineRequest
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.protocol import SamplingParams
from tests.unit.fake_runner import reference_tokens
from tests.unit.fake_swa_runner import FakeSWARunner

VOCAB = 997


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % VOCAB for i in range(n)]


def make_tree(num_pages=64, num_swa=64, P=1, window=4):
    swa = SWAPages(num_swa, num_pages, P, window)
    alloc = PageAllocator(num_pages, P)
    return SWARadixCache(alloc, P, swa), swa, alloc


def cached(tree, swa, alloc, tokens):
    """Pages for `tokens` with SWA pages, inserted into the tree (no request holds them);
    the duplicates of what the tree had go back, with their SWA pages."""
    pages = alloc.alloc(len(tokens) // tree.page_size)
    assert swa.alloc_for(pages)
    had = tree.insert(tokens, pages)
    swa.free_swa(pages[:had])
    alloc.free(pages[:had])


def req(rid, tokens, cache_salt=None):
    return SimpleNamespace(rid=rid, pages=[], num_tree_pages=0, last_node=None,
                           num_computed_tokens=0, row_stale_from=0, all_ids=list(tokens),
                           cache_salt=cache_salt)


def swa_kv(num_pages=64, num_swa=16, P=1, window=4, **kw):
    return KVManager(KVPlan.pages_only(num_pages=num_pages, page_size=P,
                                       num_swa_pages=num_swa, swa_window=window), **kw)


def make_engine(num_pages, num_swa, P, window, **cfg):
    runner = FakeSWARunner(window, page_size=P, vocab_size=VOCAB)
    engine = EngineCore(runner, SchedulerConfig(num_pages=num_pages, page_size=P,
                                                num_swa_pages=num_swa, swa_window=window,
                                                **cfg))
    return engine, runner


def run(engine, requests, max_steps=20_000, on_step=None):
    for rid, prompt, n in requests:
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(
            max_new_tokens=n, temperature=0, ignore_eos=True)))
    out = {rid: [] for rid, _, _ in requests}
    reasons = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.rid] = o.finish_reason
        if on_step is not None:
            on_step(engine)
    else:
        raise AssertionError("not drained:\n" + engine.dump_state())
    engine.check_integrity()
    return out, reasons


def assert_drained(engine):
    kv = engine.scheduler.kv
    engine.check_integrity()
    assert kv.tree.protected_pages() == 0 and kv.tree.protected_swa_pages() == 0
    swa_alloc = kv.swa.allocator
    assert swa_alloc.available_pages() + kv.tree.cached_swa_pages() == swa_alloc.num_pages


# ---------------------------------------------------------------------------- page map
def test_pages_map_slots_and_free():
    swa = SWAPages(num_swa_pages=4, num_full_pages=10, page_size=2, window=3)
    assert swa.window_pages == 1  # W - 1 = 2 earlier tokens: one page of 2
    assert swa.alloc_for([7, 3])
    assert swa.map[7] == 1 and swa.map[3] == 2
    assert swa.slots([7, 3], 0, 4) == [2, 3, 4, 5]
    assert swa.free_swa([7]) == 1 and swa.map[7] == 0
    assert swa.slots([7, 3], 1, 4) == [0, 4, 5]  # a page without an SWA page reads 0
    assert not swa.alloc_for([1, 2, 4, 5])  # all or nothing: 3 free SWA pages
    assert swa.allocator.available_pages() == 3 and swa.map[1] == 0
    swa.adopt(7, 3)
    assert swa.map == [0] * 7 + [2] + [0] * 3


def test_kv_manager_keeps_retraction_backups_beside_an_swa_pool():
    """A retraction host pool beside an SWA pool: host pages for backups (their SWA half
    under the same ids is the runner's: test_disagg_swa_pair.py, test_swa_pd_engine.py)."""
    plan = KVPlan.pages_only(num_pages=8, num_host_pages=16, num_swa_pages=4, swa_window=2,
                             host_pool_use="retraction")
    kv = KVManager(plan)
    pages = kv.alloc_backup_pages(5)
    assert len(pages) == 5 and kv.swa is not None
    kv.check_backups([pages])
    kv.free_backup_pages(pages)
    kv.check_backups([])


def test_grow_maps_every_page_and_capacity_is_the_smaller_pool():
    kv = swa_kv(num_pages=32, num_swa=6, P=2, window=4)
    assert kv.allocatable_tokens() == 12 and kv.full_allocatable_tokens() == 64
    r = req("a", ids(1, 20))
    kv.match_and_lock(r)
    assert kv.grow(r, 9)  # 5 pages
    assert all(kv.swa.map[p] for p in r.pages)
    assert kv.swa_slots(r, 0, 4) == [2, 3, 4, 5]
    assert kv.allocatable_tokens() == 2
    assert not kv.grow(r, 13)  # 2 more pages: the SWA pool has 1 left; nothing changes
    assert len(r.pages) == 5 and kv.allocator.available_pages() == 27
    kv.check_integrity([r])
    kv.release(r, insert=False)
    assert kv.swa.allocator.available_pages() == 6
    kv.check_integrity([])


def test_without_swa_pool_swa_slots_are_none():
    kv = KVManager(KVPlan.pages_only(num_pages=8))
    r = req("a", ids(1, 4))
    kv.match_and_lock(r)
    kv.grow(r, 4)
    assert kv.swa is None and kv.swa_slots(r, 0, 4) is None
    assert kv.swa_allocatable_tokens() is None


# ---------------------------------------------------------------------------- release
@pytest.mark.parametrize("P", [1, 16])
def test_out_of_window_pages_are_freed_as_decode_moves_on(P):
    window = 24
    kv = swa_kv(num_pages=4096 // P, num_swa=256 // P, P=P, window=window)
    r = req("a", ids(2, 10))
    kv.match_and_lock(r)
    for n in range(1, 400):
        assert kv.grow(r, n)
        r.num_computed_tokens = n
        kv.free_out_of_window(r)
        kv.check_integrity([r])  # includes: the next query's window is live
        live = [i for i, p in enumerate(r.pages) if kv.swa.map[p]]
        # Only pages reaching into the last window plus a page of margin keep SWA pages.
        assert live == list(range(kv.swa.release_upto(n), len(r.pages)))
        assert len(live) * P <= window + 3 * P
    assert kv.swa.allocator.num_used() == len(live)


@pytest.mark.parametrize("P", [1, 16])
def test_scheduler_frees_out_of_window_swa_pages(P):
    window = 32
    engine, runner = make_engine(num_pages=4096 // P, num_swa=128 // P, P=P, window=window,
                                 chunked_prefill_size=64)
    peak = []
    prompt = ids(3, 150)

    def watch(engine):  # SWA pages held, not counting evictable cache
        kv = engine.scheduler.kv
        peak.append(kv.swa.allocator.num_used() - kv.tree.evictable_swa_pages())
    out, _ = run(engine, [("a", prompt, 100)], on_step=watch)
    assert out["a"] == reference_tokens(prompt, 100, VOCAB)
    # A 250-token request never pinned more than a chunk and a window of SWA KV.
    assert max(peak) * P <= 64 + window + 3 * P
    assert runner.swa_reads > 0
    assert_drained(engine)


# ---------------------------------------------------------------------------- matching
def test_match_is_cut_where_the_last_window_is_tombstoned():
    tree, swa, alloc = make_tree(P=1, window=4)  # a query reads the 3 tokens before it
    a = ids(4, 8)
    cached(tree, swa, alloc, a)
    b = a[:5] + ids(5, 3)  # branch after 5 tokens: nodes [0,5) and [5,8)
    cached(tree, swa, alloc, b)
    assert tree.peek_device_pages(a) == 8
    # Tombstone the tail [5, 8) of `a`: a match may end at 5 at most ([2, 5) is live).
    tail = tree.match_prefix(a).last_node
    assert len(tail.key) == 3
    tree.evict_swa(0)  # no-op
    swa.free_swa(tail.device_pages)
    tail.swa_tombstone = True
    tree._swa_evictable_pages -= 3
    tree.check_integrity()
    assert tree.peek_device_pages(a) == 5
    m = tree.match_prefix(a)
    assert len(m.device_pages) == 5 and m.last_node is tail.parent
    assert tree.peek_device_pages(b) == 8  # the other branch is whole


def test_match_with_tombstoned_head_but_live_last_window_counts():
    tree, swa, alloc = make_tree(P=2, window=5)  # reads 4 earlier tokens: 2 pages
    a = ids(6, 16)
    cached(tree, swa, alloc, a[:8])  # node [0, 8)
    cached(tree, swa, alloc, a)  # node [8, 16) below it
    head = tree.root.children[tuple(a[:2])]
    assert len(head.key) == 8
    assert tree.evict_swa(1) == 4  # LRU, shallower first: the head becomes a tombstone
    assert head.swa_tombstone and not swa.live(head.device_pages[0])
    assert tree.peek_device_pages(a) == 8  # [8, 16): its last 2 pages are live
    assert tree.peek_device_pages(a[:10]) == 0  # a match ending at 10 reads [6, 10)
    assert tree.peek_device_pages(a[:12]) == 6  # ... ending at 12 reads [8, 12): live
    m = tree.match_prefix(a[:13])
    assert len(m.device_pages) == 6 and len(m.last_node.key) == 4  # split at 12
    tree.check_integrity()


def test_swa_eviction_drops_whole_leaves_and_tombstones_inner_nodes():
    tree, swa, alloc = make_tree(P=1, window=3)
    a = ids(7, 6)
    cached(tree, swa, alloc, a[:3])
    cached(tree, swa, alloc, a)
    assert tree.evict_swa(100) == 6
    assert not tree.root.children  # leaf dropped, then its tombstoned parent
    assert alloc.available_pages() == 64 and swa.allocator.available_pages() == 64
    tree.check_integrity()


# ---------------------------------------------------------------------------- locks
def test_lock_protects_only_the_last_window():
    kv = swa_kv(num_pages=64, num_swa=64, P=2, window=5)  # window_pages = 2
    tree = kv.tree
    prompt = ids(8, 21)
    first = req("a", prompt)
    kv.match_and_lock(first)
    kv.grow(first, 21)
    first.num_computed_tokens = 21
    kv.release(first, insert=True)  # 10 whole pages cached, all live
    assert tree.cached_swa_pages() == 10 and tree.protected_swa_pages() == 0
    second = req("b", prompt)
    assert kv.match_and_lock(second) == 20
    assert tree.protected_pages() == 10 and tree.protected_swa_pages() == 2
    assert second.swa_lock_from == 16
    # SWA pressure tombstones the rest of the locked prefix, never the last window.
    assert tree.evict_swa(100) == 8
    assert [bool(kv.swa.map[p]) for p in second.pages] == [False] * 8 + [True] * 2
    check_kv_state(kv, [second])
    # The window moving on shrinks the SWA lock page by page ...
    kv.grow(second, 40)
    second.num_computed_tokens = 25  # release_upto: (25 - 5 - 2) // 2 = 9 pages
    kv.free_out_of_window(second)
    assert second.swa_lock_from == 18 and tree.protected_swa_pages() == 1
    check_kv_state(kv, [second])
    # ... and decoding past the window drops it; the full lock stays.
    second.num_computed_tokens = 39
    kv.free_out_of_window(second)
    assert second.swa_lock_from is None and tree.protected_swa_pages() == 0
    assert tree.protected_pages() == 10
    check_kv_state(kv, [second])
    kv.release(second, insert=False)
    check_kv_state(kv, [])


def test_chunked_prefill_inserts_tombstones_and_a_later_insert_heals_them():
    P, window = 1, 3
    kv = swa_kv(num_pages=64, num_swa=64, P=P, window=window)
    prompt = ids(9, 20)
    a = req("a", prompt)
    kv.match_and_lock(a)
    kv.grow(a, 12)
    a.num_computed_tokens = 12
    kv.free_out_of_window(a)  # pages [0, 8) lose their SWA pages (12 - 3 - 1)
    kv.cache_unfinished(a)
    # A tombstoned head, a live tail, split where a's SWA lock (its last 2 pages) starts.
    nodes = sorted((len(n.key), n.swa_tombstone, n.swa_lock_ref) for n in kv.tree.nodes())
    assert nodes == [(2, False, 0), (2, False, 1), (8, True, 0)]
    check_kv_state(kv, [a])
    kv.release(a, insert=False)
    # Now a request computes the same tokens with every SWA page live: its insert heals.
    b = req("b", prompt)
    assert kv.match_and_lock(b) == 12  # [9, 12) is live: the whole cached prefix
    kv.release(b, insert=False)
    c = req("c", prompt)
    c.pages = kv.allocator.alloc(19)
    assert kv.swa.alloc_for(c.pages)
    c.last_node, c.num_computed_tokens = kv.tree.root, 19
    free_before = kv.swa.allocator.available_pages()
    kv.release(c, insert=True)
    assert not any(n.swa_tombstone for n in kv.tree.nodes())
    # 8 tombstoned pages adopted c's SWA pages; c's other duplicates went with theirs.
    assert kv.swa.allocator.available_pages() == free_before + 4
    assert kv.tree.cached_swa_pages() == 19
    check_kv_state(kv, [])


# ---------------------------------------------------------------------------- scheduler
@pytest.mark.parametrize("P", [1, 4])
def test_prefix_sharing_retraction_and_integrity(P):
    window = 8
    engine, _ = make_engine(num_pages=160 // P, num_swa=48 // P, P=P, window=window,
                            chunked_prefill_size=16)
    base = ids(10, 40)
    reqs = [(f"r{i}", base[:20 + 4 * i] + ids(20 + i, 3), 30) for i in range(6)]
    out, reasons = run(engine, reqs)
    for rid, prompt, n in reqs:
        assert reasons[rid].type == "length", reasons[rid]
        assert out[rid] == reference_tokens(prompt, n, VOCAB), rid
    assert engine.scheduler.kv.matched_tokens > 0
    assert_drained(engine)


def test_many_long_requests_run_at_once_with_a_small_swa_pool():
    """The point of the feature: 8 requests of 400 tokens each decode side by side with an
    SWA pool of 192 tokens -- not even one of them would fit there whole. Each holds at most
    5 SWA pages (window 8 + a page of margin + the page being filled), 40 of the 48."""
    P, window = 4, 8
    engine, runner = make_engine(num_pages=4000 // P, num_swa=192 // P, P=P, window=window,
                                 chunked_prefill_size=16, max_running_requests=8)
    reqs = [(f"r{i}", ids(30 + i, 40), 360) for i in range(8)]
    most = []
    out, reasons = run(engine, reqs, on_step=lambda e: most.append(len(e.scheduler.running)))
    assert all(reasons[rid].type == "length" for rid, _, _ in reqs), reasons
    assert all(out[rid] == reference_tokens(p, n, VOCAB) for rid, p, n in reqs)
    assert max(most) == 8 and 400 > 192
    assert engine.scheduler.num_retractions == 0
    assert_drained(engine)


def test_aborts_and_flush_keep_both_pools_whole():
    engine, _ = make_engine(num_pages=64, num_swa=24, P=2, window=6, chunked_prefill_size=8)
    for i in range(4):
        engine.add_request(EngineRequest(f"r{i}", ids(40, 30) + [i + 1], SamplingParams(
            max_new_tokens=20, temperature=0, ignore_eos=True)))
    for step in range(12):
        engine.step()
        if step in (3, 7):
            engine.abort_request(f"r{step // 4}")
    run(engine, [])
    assert_drained(engine)
    assert engine.scheduler.kv.flush()
    kv = engine.scheduler.kv
    assert kv.swa.allocator.available_pages() == 24 and kv.allocator.available_pages() == 64


def test_pd_decode_extras_take_an_swa_pool():
    """The decode radix cache is the SWA radix cache, decode HiCache the SWA HiRadix cache
    (PD with them: tests/unit/test_disagg_swa_pair.py)."""
    SchedulerConfig(num_pages=64, num_swa_pages=16, swa_window=4, disaggregation_mode="prefill")
    for host, tree in ((0, SWARadixCache), (64, SWAHiRadixCache)):
        cfg = SchedulerConfig(num_pages=64, num_swa_pages=16, swa_window=4,
                              disaggregation_mode="decode", num_host_pages=host,
                              disaggregation_decode_enable_radix_cache=True,
                              host_pool_use="hicache" if host else None)
        assert type(KVManager(cfg.plan).tree) is tree


def test_an_swa_pool_below_one_window_aborts_with_a_clear_error():
    engine, _ = make_engine(num_pages=256, num_swa=4, P=1, window=8)
    out, reasons = run(engine, [("a", ids(50, 20), 4), ("b", ids(51, 3), 2)])
    # Refused on arrival (engine_core: it needs 10 SWA tokens at once), not after a stall.
    assert reasons["a"].type == "abort" and reasons["a"].status_code == 400
    assert "sliding-window KV pool (4 tokens)" in reasons["a"].message, reasons["a"]
    assert reasons["b"].type == "length" and out["b"] == reference_tokens(ids(51, 3), 2, VOCAB)
    assert_drained(engine)
