"""HiCache L2 with hybrid SWA memory, without torch (cache/swa_hiradix.py): host copies carry
a live node's SWA pages, demotion frees both device pools, a load-back maps SWA pages where
the host copy has them, and the window-aware match counts what will be resident after the
load-back. The fake SWA runner (tests/unit/fake_swa_runner.py) checks every window read
against the full pool's KV, so a missed SWA copy or a stale page fails the run."""
from __future__ import annotations

import pytest

from kvstrata.cache.hiradix_cache import WRITE_POLICIES
from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.swa_hiradix import SWAHiRadixCache
from kvstrata.cache.swa_pages import SWAPages
from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.request import EngineRequest
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.protocol import SamplingParams
from tests.unit.fake_runner import reference_tokens
from tests.unit.fake_swa_runner import FakeSWARunner

VOCAB = 997


def make_tree(num_pages=32, num_swa=32, num_host=64, P=1, window=4, policy="write_through"):
    swa = SWAPages(num_swa, num_pages, P, window)
    tree = SWAHiRadixCache(PageAllocator(num_pages, P), P, PageAllocator(num_host, P), swa,
                           policy)
    return tree, swa


def insert_live(tree, swa, tokens, dead_head=0):
    """Fresh pages with SWA pages (the first `dead_head` pages released, as a request that
    decoded past them) inserted into the tree; the copies end at once."""
    pages = tree.allocator.alloc(len(tokens) // tree.page_size)
    assert swa.alloc_for(pages)
    swa.free_swa(pages[:dead_head])
    assert tree.insert(tokens, pages) == 0
    finish_copies(tree)
    return pages


def finish_copies(tree):
    ops, tree.pending_ops = tree.pending_ops, []
    for op in ops:
        tree.on_transfer_done(op.job_id, True)
    return ops


def test_host_copy_carries_live_swa_pages_and_load_back_maps_them():
    tree, swa = make_tree()
    tokens = list(range(10, 22))  # 12 pages, window 4 -> the last 3 pages matter
    insert_live(tree, swa, tokens, dead_head=6)
    # Two nodes by liveness: a tombstoned head written without SWA, a live tail with it.
    head, = tree.root.children.values()
    tail, = head.children.values()
    assert head.swa_tombstone and not head.host_swa and head.host_pages is not None
    assert not tail.swa_tombstone and tail.host_swa and len(tail.host_pages) == 6
    assert swa.allocator.num_used() == 6
    # Demote everything: both pools' device pages go, the host copy stays.
    assert tree.evict(12) == 12
    assert not head.device_pages and not tail.device_pages
    assert swa.allocator.num_used() == 0 and tree.cached_swa_pages() == 0
    tree.check_integrity()
    # The whole prefix is usable after load-back (its last window is on the host with SWA).
    match = tree.match_prefix(tokens)
    assert match.device_pages == [] and len(match.host_pages) == 12
    dev = tree.allocator.alloc(12)
    node = tree.load_back(match, dev)
    op, = finish_copies(tree)
    # only the last window's pages (3) load with their SWA half: the live tail is split there
    assert op.kind == "h2d" and op.swa_pages[:9] == [0] * 9 and all(op.swa_pages[9:])
    assert node is tail and not tail.swa_tombstone and head.swa_tombstone
    assert tail.parent.swa_tombstone and tail.parent.host_swa and tail.parent.parent is head
    assert [swa.map[p] for p in dev[9:]] == op.swa_pages[9:]
    assert tree.evictable_swa_pages() == 3
    tree.check_integrity()


def test_a_host_prefix_longer_than_the_swa_pool_loads_back_with_its_window():
    """A prefix written live (write-through: its host copy holds every page's SWA half) that
    is longer than the whole SWA pool: the load-back maps SWA pages for its last window only
    (split off as a live node; the rest loads as a tombstone, its host copy keeping the SWA
    half), so it fits; a load-back asking for every page's SWA half would not."""
    tree, swa = make_tree(num_pages=32, num_swa=8, window=4, P=1)
    tokens = list(range(50, 70))                  # 20 pages > the 8-page SWA pool
    pages = tree.allocator.alloc(20)
    for i in range(0, 20, 4):                     # live as written, 4 pages at a time ...
        assert swa.alloc_for(pages[i:i + 4])
        tree.insert(tokens[:i + 4], pages[:i + 4])
        finish_copies(tree)
        if i + 4 < 20:
            assert tree.evict_swa(4) == 4         # ... then tombstoned to make room
    assert all(n.host_swa for n in tree.nodes() if n is not tree.root)
    assert tree.evict(20) == 20                   # demoted: host-only, every SWA half there
    match = tree.match_prefix(tokens)
    assert len(match.host_pages) == 20
    need = swa.window_pages
    assert tree.swa_pages_to_load(match) == need < swa.allocator.num_pages < 20
    node = tree.load_back(match, tree.allocator.alloc(20))
    op, = finish_copies(tree)
    assert op.swa_pages[:20 - need] == [0] * (20 - need) and all(op.swa_pages[20 - need:])
    assert node is match.last_host_node and len(node.device_pages) == need
    assert not node.swa_tombstone and node.parent.swa_tombstone and node.parent.host_swa
    assert swa.allocator.num_used() == need == tree.evictable_swa_pages()
    tree.check_integrity()
    assert len(tree.match_prefix(tokens).device_pages) == 20   # usable to its end


def test_match_cuts_where_the_host_copy_lacks_the_last_window():
    """A node tombstoned before its write has no SWA K/V anywhere: a hit ending there is cut
    back to the last end whose window is live (recomputed, not read stale)."""
    tree, swa = make_tree()
    tokens = list(range(30, 42))
    insert_live(tree, swa, tokens[:8])            # live, written with SWA
    assert tree.evict_swa(8) == 8                 # tombstoned on the device ...
    tree.check_integrity()
    assert tree.peek_device_pages(tokens[:8]) == 0  # ... so unusable as it stands,
    match = tree.match_prefix(tokens[:8])         # but its host copy has the SWA half
    assert len(match.device_pages) == 8 and tree.needs_load(match)
    # Once demoted, the host copy is usable as any.
    assert tree.evict(8) == 8
    match = tree.match_prefix(tokens[:8])
    assert len(match.host_pages) == 8
    tree.check_integrity()
    # A tail written while tombstoned: its host copy has no SWA half.
    tree2, swa2 = make_tree()
    pages = tree2.allocator.alloc(12)
    assert swa2.alloc_for(pages)
    swa2.free_swa(pages[8:])                      # the tail's SWA released before insert
    tree2.insert(tokens, pages)
    finish_copies(tree2)
    tree2.evict(12)
    match = tree2.match_prefix(tokens)
    assert len(match.host_pages) == 8             # cut at the live head's end
    assert tree2.total_cut_tokens == 4
    tree2.check_integrity()


def test_a_match_ending_among_tombstones_revives_their_window_from_the_host():
    """A long prefix's load-back leaves the pages before its last window as device
    tombstones whose host copy keeps the SWA half. A shorter prompt ending among them (one
    that diverges inside the prefix) still hits: the load-back gives just the window before
    its end SWA pages and moves only the host copy's SWA half into them (the full pages,
    maybe read by running requests, stay as they are)."""
    tree, swa = make_tree(num_pages=32, num_swa=24, window=4, P=1)
    tokens = list(range(100, 120))                # 20 pages, every one written live
    insert_live(tree, swa, tokens)
    assert tree.evict(20) == 20
    long_match = tree.match_prefix(tokens)
    tree.load_back(long_match, tree.allocator.alloc(20))
    finish_copies(tree)
    assert swa.allocator.num_used() == swa.window_pages     # only the long one's window
    short = tokens[:9] + [7, 7, 7]                # diverges at page 9: its end is among them
    assert tree.peek_device_pages(short) == 0     # dead as it stands ...
    match = tree.match_prefix(short)
    assert len(match.device_pages) == 9 and not match.host_pages  # ... revivable
    assert tree.needs_load(match) and tree.swa_pages_to_load(match) == swa.window_pages
    node = tree.load_back(match, [])
    op, = finish_copies(tree)
    assert node is match.last_node and not node.swa_tombstone
    assert op.kind == "h2d" and op.swa_only and op.device_pages == node.device_pages
    assert op.swa_pages == [swa.map[p] for p in node.device_pages] and all(op.swa_pages)
    assert op.host_pages == node.host_pages and len(node.device_pages) == swa.window_pages
    assert node.parent.swa_tombstone and tree.swa_revived_pages == swa.window_pages
    assert tree.peek_device_pages(short) == 9 and not tree.needs_load(tree.match_prefix(short))
    tree.check_integrity()


def test_swa_eviction_spares_a_node_being_written():
    tree, swa = make_tree()
    pages = tree.allocator.alloc(6)
    assert swa.alloc_for(pages)
    tree.insert(list(range(6)), pages)            # write-through: an async write in flight
    assert tree.evict_swa(6) == 0                 # it reads those SWA pages
    finish_copies(tree)
    assert tree.evict_swa(6) == 6
    tree.check_integrity()


# ---------------------------------------------------------------------------- engine
def multi_turn(engine, conversations=3, turns=4, system_len=20, user_len=6, answer=6):
    system = [(7 * i + 3) % VOCAB for i in range(system_len)]
    history = {c: list(system) for c in range(conversations)}
    for t in range(turns):
        for c in range(conversations):
            history[c] += [(c * 97 + t * 31 + i * 13) % VOCAB for i in range(user_len)]
            rid = f"c{c}t{t}"
            engine.add_request(EngineRequest(rid, list(history[c]), SamplingParams(
                max_new_tokens=answer, temperature=0, ignore_eos=True)))
            got = []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    got += out.new_token_ids
            assert got == reference_tokens(history[c], answer, VOCAB), rid
            history[c] += got
            engine.check_integrity()


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("P,chunk", [(1, 8), (4, None)])
def test_starved_pools_demote_and_load_back(policy, P, chunk):
    runner = FakeSWARunner(4, page_size=P, vocab_size=VOCAB)
    cfg = dict(chunked_prefill_size=chunk) if chunk else {}
    engine = EngineCore(runner, SchedulerConfig(
        num_pages=80 // P, page_size=P, num_swa_pages=32 // P, swa_window=4,
        num_host_pages=1024 // P, hicache_write_policy=policy, **cfg))
    multi_turn(engine)
    kv = engine.scheduler.kv
    assert isinstance(kv.tree, SWAHiRadixCache)
    assert kv.tree.stats.demoted_pages > 0 and runner.moved_swa_pages["d2h"] > 0
    if policy != "write_through_selective":  # (selective writes nodes already tombstoned)
        assert kv.tree.stats.host_hit_tokens > 0 and runner.moved_swa_pages["h2d"] > 0
    assert runner.swa_reads > 0
    assert engine.flush_cache()
    assert kv.swa.allocator.available_pages() == kv.swa.allocator.num_pages
    assert kv.host_allocator.available_pages() == kv.host_allocator.num_pages
