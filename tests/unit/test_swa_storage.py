"""HiCache L3 with hybrid SWA memory, without torch (cache/swa_storage.py): backups store a
full record per page and an SWA record where the host copy holds the window layers' K/V,
under keys that name the component; a restarted engine restores both halves and the
window-aware match uses the prefix only up to an end whose window came back. The fake SWA
runner (tests/unit/fake_swa_runner.py) reads every window back through swa_slots and checks
it against the full pool's KV, so a page restored without its SWA half, or with another
page's, fails the run; check_integrity runs after every step (KVSTRATA_CHECK_INTEGRITY)."""
from __future__ import annotations

from kvstrata.cache.swa_storage import SWAStorageTier
from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.protocol import TransferOp, of_type
from tests.unit.fake_runner import FakeStorage, reference_tokens
from tests.unit.fake_swa_runner import FakeSWARunner
from tests.unit.test_hicache_storage import (PROMPT, VOCAB, add, assert_host_pool_whole,
                                             kv_of, run)
from tests.unit.test_hicache_storage import make as make_uniform

WINDOW, P = 8, 4  # the window's pages before a match end: ceil((8 - 1) / 4) = 2


def make(store, *, device_pages=40, swa_pages=20, host_pages=80, chunk=None,
         extra='{"prefetch_threshold": 8}'):
    runner = FakeSWARunner(WINDOW, page_size=P, vocab_size=VOCAB, storage=store)
    engine = EngineCore(runner, SchedulerConfig(
        num_pages=device_pages, page_size=P, num_swa_pages=swa_pages, swa_window=WINDOW,
        num_host_pages=host_pages, hicache_storage_backend="memory",
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_backend_extra_config=extra,
        **({"chunked_prefill_size": chunk} if chunk else {})))
    return engine, runner


def storage_ops(runner, kind):
    return [op for so in runner.steps for op in of_type(so.ops, TransferOp) if op.kind == kind]


def warm_store(**kw):
    """A first engine computes PROMPT and backs it up; returns the store and its runner."""
    store = FakeStorage()
    engine, runner = make(store, **kw)
    assert isinstance(kv_of(engine).storage, SWAStorageTier)
    add(engine, "warm", PROMPT)
    assert run(engine)["warm"] == reference_tokens(PROMPT, 4, VOCAB)
    assert runner.swa_reads > 0
    return store, runner


def test_backups_store_what_the_host_copy_holds_under_component_keys():
    store, runner = warm_store()
    ops = storage_ops(runner, "h2s")
    assert ops and all(k.startswith("full-") for op in ops for k in op.keys)
    assert all(s == "swa-" + k[5:] for op in ops for s, k in zip(op.swa_keys, op.keys))
    # write_through writes each page when it enters the tree, still live: both records
    full = {k[5:] for k in store.pages if k.startswith("full-")}
    swa = {k[4:] for k in store.pages if k.startswith("swa-")}
    assert len(full) == 24 and swa == full and len(store.pages) == 48


def test_decoded_pages_past_the_window_are_stored_full_only_and_cut_a_match():
    """A long decode gives up the SWA pages of its own pages behind the window, so they
    enter the tree -- and storage -- as a tombstone: full records only, SWA records for the
    prompt and the last window. A restarted engine restores the whole sequence; a prompt
    that leaves it mid-decode finds no stored window there and is cut back to the prompt."""
    store = FakeStorage()
    engine, _ = make(store)
    prompt = PROMPT[:8]
    add(engine, "long", prompt, n=60)
    out = run(engine)["long"]
    assert out == reference_tokens(prompt, 60, VOCAB)
    full = [k for k in store.pages if k.startswith("full-")]
    swa = [k for k in store.pages if k.startswith("swa-")]
    assert len(full) == (8 + 59) // P and 2 + 2 <= len(swa) < len(full) - 4, (full, swa)
    seq = prompt + out
    for cut, hit_at_least in ((64, 64 - P), (40, 8)):
        ask = seq[:cut] + [5, 6, 7, 8, 9]
        engine, runner = make(store)
        add(engine, "r", ask, n=3)
        assert run(engine)["r"] == reference_tokens(ask, 3, VOCAB)
        tree = kv_of(engine).tree
        assert kv_of(engine).storage.stats.hit_tokens >= cut - P
        assert tree.stats.host_hit_tokens >= hit_at_least, (cut, tree.stats)
        if cut == 40:  # no window stored at 40: back to the prompt's (live) end
            assert tree.stats.host_hit_tokens == 8 and tree.total_cut_tokens >= 32
        assert_host_pool_whole(engine)


def test_restarted_engine_restores_both_halves_and_continues_exactly():
    store, _ = warm_store()
    # Fresh device and host pools, the same store. (The SWA pool's 20 pages are fewer than
    # the 23 restored: the load-back takes SWA pages only for the window that came back.)
    engine, runner = make(store)
    add(engine, "again", PROMPT)
    assert run(engine)["again"] == reference_tokens(PROMPT, 4, VOCAB)
    kv = kv_of(engine)
    st = kv.storage.stats
    assert st.hit_tokens == 92 and st.prefetch_complete == 1
    assert kv.tree.stats.host_hit_tokens == 92  # loaded back, SWA halves where read
    assert runner.computed_tokens == 96 - 92 + 3  # the last page and the decode only
    prefetch, = storage_ops(runner, "s2h")
    assert prefetch.swa_keys == ["swa-" + k[5:] for k in prefetch.keys]
    # only the window before the match end came back with its SWA half
    assert runner.moved_swa_pages["h2d"] == 2 and sum(s.startswith("swa-") for s in store.pages) == 24
    assert_host_pool_whole(engine)
    assert kv.swa.allocator.num_used() == kv.tree.cached_swa_pages()


def test_a_prefix_whose_window_is_not_stored_is_cut_back_and_recomputed():
    store, _ = warm_store()
    for key in [k for k in store.pages if k.startswith("swa-")]:
        del store.pages[key]  # full records only (what a window-less backup leaves)
    engine, runner = make(store)
    add(engine, "again", PROMPT)
    assert run(engine)["again"] == reference_tokens(PROMPT, 4, VOCAB)
    kv = kv_of(engine)
    assert kv.storage.stats.hit_tokens == 92  # read, but no end of it has a window
    assert kv.tree.stats.host_hit_tokens == 0 and kv.tree.total_cut_tokens >= 92
    assert runner.computed_tokens == 96 + 3
    assert_host_pool_whole(engine)


def test_uniform_and_swa_pool_records_never_mix():
    """The same prompt, the same memory store: a uniform-pool engine's records (bare keys,
    every layer in one record) are no hit for an SWA-pool engine, nor the other way round."""
    uniform = FakeStorage()
    engine, _ = make_uniform(uniform)
    add(engine, "u", PROMPT)
    run(engine)
    assert uniform.pages and not any(k.startswith(("full-", "swa-")) for k in uniform.pages)
    engine, runner = make(uniform)
    add(engine, "s", PROMPT)
    assert run(engine)["s"] == reference_tokens(PROMPT, 4, VOCAB)
    assert kv_of(engine).storage.stats.hit_tokens == 0 and runner.computed_tokens == 99
    swa_store, _ = warm_store()
    engine, runner = make_uniform(swa_store)
    add(engine, "u2", PROMPT)
    assert run(engine)["u2"] == reference_tokens(PROMPT, 4, VOCAB)
    assert kv_of(engine).storage.stats.hit_tokens == 0 and runner.computed_tokens == 99


def multi_turn(engine, turns=4, conversations=2, flush=True):
    """Conversations whose every turn extends the last; before each turn the device and
    host tiers are emptied (flush_cache), so a turn's prefix can only come from storage."""
    system = [(7 * i + 3) % VOCAB for i in range(20)]
    history = {c: list(system) for c in range(conversations)}
    for t in range(turns):
        for c in range(conversations):
            history[c] += [(c * 97 + t * 31 + i * 13) % VOCAB for i in range(6)]
            if flush:
                assert engine.finish_storage_backups(timeout=5) and engine.flush_cache()
            add(engine, f"c{c}t{t}", history[c], n=6)
            got = run(engine)[f"c{c}t{t}"]
            assert got == reference_tokens(history[c], 6, VOCAB), (c, t)
            history[c] += got


def test_multi_turn_from_storage_through_starved_pools():
    """Small pools, chunked prompts: every turn's prefix comes back from storage into a host
    pool too small for the conversations, with the tokens of a run alone."""
    engine, runner = make(FakeStorage(delay=2), device_pages=24, swa_pages=8, host_pages=24,
                          chunk=8)
    multi_turn(engine)
    kv = kv_of(engine)
    assert kv.storage.stats.hit_tokens > 0 and kv.tree.stats.host_hit_tokens > 0
    assert runner.moved_swa_pages["h2d"] > 0 and runner.swa_reads > 0
    assert_host_pool_whole(engine)
    assert engine.flush_cache()
    assert kv.swa.allocator.available_pages() == kv.swa.allocator.num_pages
    assert kv.host_allocator.available_pages() == kv.host_allocator.num_pages


def test_a_window_straddling_the_tree_end_without_its_swa_half_is_healed_from_storage():
    """A restore reads the SWA records of the window before its end only, so the earlier
    pages load back as device tombstones whose host copy has no SWA half. A prompt that
    diverges among them (its cached prefix ends there) finds that window dead on every tier
    here, and nothing of its own in storage. The fetch therefore starts a window before the
    tree's end (the lead); those tombstones take the fetched copy as their host copy, both
    halves, and the load-back brings the SWA half to the device (their full pages stay), so
    the prefix hits; the fake runner checks every window read. Without the lead the whole
    prompt is recomputed."""
    store, _ = warm_store()
    engine, runner = make(store, extra='{"prefetch_threshold": 4}')
    kv, tree, T, D = kv_of(engine), kv_of(engine).tree, 10, 6
    first = PROMPT[:T * P + 1]
    add(engine, "first", first, n=1)
    assert run(engine)["first"] == reference_tokens(first, 1, VOCAB)
    assert kv.storage.stats.hit_tokens == T * P
    ask = PROMPT[:D * P] + [t % (VOCAB - 1) + 1 for t in PROMPT[D * P:(D + 1) * P]] + [3]
    assert kv.peek_prefix_len(ask) == 0       # the window before page D: tombstones
    computed = runner.computed_tokens
    add(engine, "ask", ask, n=1)
    assert run(engine)["ask"] == reference_tokens(ask, 1, VOCAB)
    # the lead (pages D - 2, D - 1) read; page D, the prompt's own, is not in the store
    assert kv.storage.stats.hit_tokens == T * P + 2 * P
    assert kv.storage.stats.swa_healed_pages == 2 and tree.swa_revived_pages == 2
    assert runner.computed_tokens - computed == len(ask) - D * P
    assert_host_pool_whole(engine)
    engine.check_integrity()


def test_after_swa_eviction_a_host_copy_with_the_window_revives_it():
    """The tree holds a restored prefix whose SWA pages were then evicted (device tombstones,
    full layers only); the host copy of its last window still has the SWA half. A prompt
    one page longer hits the whole tree part: the load-back brings that window's SWA half
    back (SWAHiRadixCache._revive, no storage read for it), the page past the tree's end
    comes from storage, and only the last token is computed."""
    store, _ = warm_store()
    engine, runner = make(store, extra='{"prefetch_threshold": 4}')
    kv, tree, T = kv_of(engine), kv_of(engine).tree, 10
    first = PROMPT[:T * P + 1]
    add(engine, "first", first, n=1)
    assert run(engine)["first"] == reference_tokens(first, 1, VOCAB)
    assert tree.evict_swa(tree.evictable_swa_pages()) > 0  # SWA pressure: full pages stay
    assert tree.evictable_swa_pages() == 0 and kv.peek_prefix_len(first) == 0
    ask = PROMPT[:(T + 1) * P + 1]
    computed, moved = runner.computed_tokens, runner.moved_pages["h2d"]
    add(engine, "ask", ask, n=1)
    assert run(engine)["ask"] == reference_tokens(ask, 1, VOCAB)
    assert kv.storage.stats.hit_tokens == T * P + P and kv.storage.stats.swa_healed_pages == 0
    assert tree.swa_revived_pages == 1  # the window before the end: that page, the tree's last
    assert runner.moved_pages["h2d"] - moved == 1  # full pages: the fetched page only
    assert runner.computed_tokens - computed == 1
    assert_host_pool_whole(engine)
    engine.check_integrity()
