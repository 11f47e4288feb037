"""Hybrid SWA memory across PD through the torch-free pair (pd_fake_swa.py): the prefill sends
the full pages of the whole prompt and the SWA pages of its last window only; the decode
allocates SWA pages for that tail only (its SWA pool is smaller than one prompt here), maps
them and decodes; the fake model reads every window position back through the SWA table, so
a missing, wrong or early-freed SWA page changes a token or fails an assertion. Decode
retraction backs up and restores the live window's SWA pages (cpu_tensor)."""
from __future__ import annotations

import pytest

from kvstrata.cache.swa_pd import tail_start_page
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.engine.sides.registry import pd_side
from tests.unit.fake_runner import reference_tokens
from tests.unit.pd_fake_swa import swa_pair

VOCAB = 1000


def prompt(seed, n):
    return [(seed * 131 + i * 17 + 3) % VOCAB for i in range(n)]


def swa_drained(engine):
    kv = engine.scheduler.kv
    engine.check_integrity()
    assert kv.tree.protected_swa_pages() == 0
    alloc = kv.swa.allocator
    assert alloc.available_pages() + kv.tree.cached_swa_pages() == alloc.num_pages


@pytest.mark.parametrize("P,window,chunk,reserved", [(1, 8, None, 8), (16, 20, 32, 8),
                                                     (4, 9, 12, 8), (1, 8, None, 512)])
def test_long_prompts_decode_exactly_with_only_the_last_window_sent(P, window, chunk,
                                                                    reserved):
    """reserved: --num-reserved-decode-tokens (512 is the default: more than the SWA pool)"""
    lengths = [n * (4 if P >= 16 else 1) for n in (150, 97, 64, 200)]
    # decode SWA pool: fewer tokens than one prompt, enough for a few windows
    decode_swa = 3 * (-(-(window + 1) // P) + 2)
    pages = 4096 // P + 8
    pair = swa_pair(P, window, prefill_pages=pages, decode_pages=pages, prefill_swa=pages,
                    decode_swa=decode_swa,
                    prefill_cfg={"chunked_prefill_size": chunk} if chunk else None,
                    decode_cfg={"num_reserved_decode_tokens": reserved})
    assert decode_swa * P < min(lengths)
    prompts = {f"r{i}": prompt(i, n) for i, n in enumerate(lengths)}
    for rid, p in prompts.items():
        pair.submit(rid, p, 12, ignore_eos=True)
    pair.run()
    for rid, p in prompts.items():
        assert pair.outputs["decode"][rid] == reference_tokens(p, 12, VOCAB), rid
    # only the last window's SWA pages crossed, per room
    tails = sum(-(-n // P) - tail_start_page(n, window, P) for n in lengths)
    assert pair.hub.swa_pages_moved == tails
    assert pair.hub.moved_pages == sum(-(-n // P) for n in lengths) + tails
    assert pair.decode_runner.swa_reads > 0
    for engine in (pair.prefill, pair.decode):
        swa_drained(engine)


@pytest.mark.parametrize("backend", ["cpu_tensor", "host_pool"])
def test_a_pressured_decode_retracts_and_restores_the_window_exactly(backend):
    P, window = 4, 9
    # room for about two requests' full pages: the third's decode growth forces retraction
    host = {"num_host_pages": 40} if backend == "host_pool" else {}
    pair = swa_pair(P, window, prefill_pages=256, decode_pages=40, prefill_swa=256,
                    decode_swa=40, decode_cfg={"num_reserved_decode_tokens": 1,
                                               "max_running_requests": 4,
                                               "disaggregation_decode_retraction_backup":
                                                   backend, **host})
    prompts = {f"r{i}": prompt(10 + i, 50 + 3 * i) for i in range(4)}
    for rid, p in prompts.items():
        pair.submit(rid, p, 30, ignore_eos=True)
    pair.run()
    for rid, p in prompts.items():
        assert pair.outputs["decode"][rid] == reference_tokens(p, 30, VOCAB), rid
    store = pair.decode_runner.backups
    assert store.count("backup", backend) >= 1 and \
        store.count("restore", backend) == store.count("backup", backend)
    assert store.count("backup") == store.count("backup", backend)
    assert store.swa_backed_up[backend] >= 1 and not store.swa_cpu
    for engine in (pair.prefill, pair.decode):
        swa_drained(engine)


@pytest.mark.parametrize("P,window", [(1, 8), (4, 9), (16, 20)])
def test_decode_radix_hits_send_only_the_delta(P, window):
    """--disaggregation-decode-enable-radix-cache over the SWA radix cache: a follow-up turn
    whose cached prefix covers part of its last window (a short delta) takes the tree's live
    SWA pages there, so only the delta's full and SWA pages cross (prefix_swa_pages skips
    the held ones); a long delta moves its whole last window; answers stay exact. Each turn
    generates more than a window and a page: the decode received SWA pages for its prompt's
    last window only, so a hit at the end of a shorter answer would lack live SWA pages
    before its end (test_a_decode_radix_hit_needs_a_live_window_before_its_end)."""
    new = window + 2 * P
    pages = 2048 // P
    pair = swa_pair(P, window, prefill_pages=pages, decode_pages=pages, prefill_swa=pages,
                    decode_swa=pages, decode_cfg={"disaggregation_decode_enable_radix_cache":
                                                  True})
    side = pd_side(pair.decode.scheduler)
    base = prompt(1, 12 * P + 3)
    pair.submit("t1", base, new, ignore_eos=True)
    pair.run()
    history = base + pair.outputs["decode"]["t1"]
    for turn, delta in enumerate((3, window + 3 * P)):
        ids = history + prompt(50 + turn, delta)
        hub_full = pair.hub.moved_pages - pair.hub.swa_pages_moved
        hub_swa, hits = pair.hub.swa_pages_moved, side.prefix_hit_tokens
        rid = f"t{turn + 2}"
        pair.submit(rid, ids, new, ignore_eos=True)
        pair.run()
        assert pair.outputs["decode"][rid] == reference_tokens(ids, new, VOCAB), rid
        held = side.prefix_hit_tokens - hits
        # the tree holds every whole page of the earlier turn's prompt and output but the
        # last token's (its KV is computed only by the next step, which never ran)
        assert held == (len(history) - 1) // P * P, (held, len(history))
        n, k = -(-len(ids) // P), held // P
        first = tail_start_page(len(ids), window, P)
        assert pair.hub.moved_pages - pair.hub.swa_pages_moved - hub_full == n - k
        assert pair.hub.swa_pages_moved - hub_swa == n - max(first, k)
        if turn == 0:
            assert k > first, "the short delta's window starts inside the prefix"
        history = ids + pair.outputs["decode"][rid]
    for engine in (pair.prefill, pair.decode):
        swa_drained(engine)


def test_a_decode_radix_hit_needs_a_live_window_before_its_end():
    """A starved decode SWA pool tombstones cached windows (chats sharing a prefix: the
    shared node stays, tombstoned): a follow-up's hit is cut back to the longest prefix whose
    last window is live (or to none), the rest re-sent, still exact; the pools are whole
    after every drain."""
    P, window = 4, 9
    pair = swa_pair(P, window, prefill_pages=512, decode_pages=512, prefill_swa=512,
                    decode_swa=3 * (-(-(window + 1) // P) + 2),
                    decode_cfg={"disaggregation_decode_enable_radix_cache": True,
                                "max_running_requests": 2})
    side, kv = pd_side(pair.decode.scheduler), pair.decode.scheduler.kv
    shared = prompt(5, 30)
    chats = {f"c{i}": shared + prompt(70 + i, 10 + 5 * i) for i in range(4)}
    for rid, ids in chats.items():
        pair.submit(rid, ids, 14, ignore_eos=True)
    pair.run()
    for rid, ids in chats.items():
        assert pair.outputs["decode"][rid] == reference_tokens(ids, 14, VOCAB), rid
    got = []
    for rid, ids in chats.items():
        follow = ids + pair.outputs["decode"][rid] + prompt(90, 2)
        hits = side.prefix_hit_tokens
        usable = kv.peek_prefix_len(follow, whole_prompt=True)
        pair.submit(rid + "+", follow, 5, ignore_eos=True)
        pair.run()
        assert pair.outputs["decode"][rid + "+"] == reference_tokens(follow, 5, VOCAB), rid
        got.append(side.prefix_hit_tokens - hits)
        assert got[-1] == usable
        for engine in (pair.prefill, pair.decode):
            swa_drained(engine)
    assert kv.tree.total_cut_tokens > 0, "no hit was cut by a tombstone: the pool is not starved"
    assert max(got) > 0, got


@pytest.mark.parametrize("backup", ["cpu_tensor", "host_pool"])
def test_decode_hicache_with_a_starved_pool_loads_windows_back(backup):
    """Decode HiCache over the SWA HiRadix cache: a decode device pool of a few requests'
    pages demotes cached conversations to the host (full pages and, where live, SWA pages);
    follow-ups load them back -- SWA pages mapped to the new full pages -- and answer exactly;
    host_pool backups share the one host pool. Pools (both, host too) whole after drains."""
    P, window = 4, 9
    pair = swa_pair(P, window, prefill_pages=512, decode_pages=48, prefill_swa=512,
                    decode_swa=40, decode_cfg={
                        "disaggregation_decode_enable_radix_cache": True,
                        "num_host_pages": 256, "host_pool_use": "hicache",
                        "disaggregation_decode_retraction_backup": backup,
                        "max_running_requests": 3, "num_reserved_decode_tokens": 1})
    side, kv = pd_side(pair.decode.scheduler), pair.decode.scheduler.kv
    assert kv.hicache and kv.swa is not None
    chats = {f"c{i}": prompt(30 + i, 40 + 7 * i) for i in range(5)}
    for rid, ids in chats.items():
        pair.submit(rid, ids, window + 2 * P, ignore_eos=True)
    pair.run()
    for rid, ids in chats.items():
        assert pair.outputs["decode"][rid] == reference_tokens(ids, window + 2 * P, VOCAB)
    hits = side.prefix_hit_tokens
    follow = {rid + "+": ids + pair.outputs["decode"][rid] + prompt(90, 3)
              for rid, ids in chats.items()}
    for rid, ids in follow.items():  # at once: decode growth retracts one (a backup)
        pair.submit(rid, ids, 20, ignore_eos=True)
    pair.run()
    for rid, ids in follow.items():
        assert pair.outputs["decode"][rid] == reference_tokens(ids, 20, VOCAB), rid
    for engine in (pair.prefill, pair.decode):
        swa_drained(engine)
    runner = pair.decode_runner
    assert side.prefix_hit_tokens - hits > 0
    assert runner.backups.count("backup", backup) >= 1
    assert runner.backups.swa_backed_up[backup] >= 1
    assert runner.moved_swa_pages["d2h"] > 0 and runner.moved_swa_pages["h2d"] > 0, \
        "no window went to the host and back: the device pool is not starved"
