"""HiCache L3 bookkeeping without torch: backups to a fake store, prefetch on arrival, each
prefetch policy's admission rule, aborts and failures. The fake runner moves fake KV through
host pages and the store, so a wrong page or key changes the tokens."""
from __future__ import annotations

import pytest

from kvstrata.cache.storage_tier import PrefetchConfig
from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.request import EngineRequest
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.protocol import SamplingParams
from tests.unit.fake_runner import FakeRunner, FakeStorage, reference_tokens

VOCAB = 1000
PROMPT = [(13 * i + 5) % VOCAB for i in range(96)]


def make(storage, *, page_size=4, policy="timeout", extra='{"prefetch_threshold": 8}',
         device_pages=40, host_pages=80, write_policy="write_through"):
    runner = FakeRunner(page_size=page_size, vocab_size=VOCAB, storage=storage)
    engine = EngineCore(runner, SchedulerConfig(
        num_pages=device_pages, page_size=page_size, num_host_pages=host_pages,
        hicache_write_policy=write_policy, hicache_storage_backend="memory",
        hicache_storage_prefetch_policy=policy, hicache_storage_backend_extra_config=extra))
    return engine, runner


def add(engine, rid, prompt, n=4):
    engine.add_request(EngineRequest(rid, list(prompt), SamplingParams(
        max_new_tokens=n, temperature=0, ignore_eos=True)))


def run(engine, max_steps=400):
    got: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            got.setdefault(out.rid, []).extend(out.new_token_ids)
    assert not engine.has_unfinished_requests(), engine.dump_state()
    engine.check_integrity()
    return got


def kv_of(engine):
    return engine.scheduler.kv


def assert_host_pool_whole(engine):
    kv = kv_of(engine)
    tree = kv.tree
    assert not tree.storage.busy() and tree.storage.occupied_pages == 0
    assert kv.host_allocator.num_used() == sum(len(n.host_pages or []) for n in tree.nodes())


def warm_store(prompt=PROMPT, **kw):
    """A first engine computes `prompt` and backs it up; returns the store."""
    store = FakeStorage()
    engine, _ = make(store, **kw)
    add(engine, "warm", prompt)
    assert run(engine)["warm"] == reference_tokens(prompt, 4, VOCAB)
    # prompt + 3 decoded tokens computed: 99 tokens, 24 whole pages
    assert kv_of(engine).storage.stats.backup_pages == (len(prompt) + 3) // 4
    return store


def test_restarted_engine_serves_the_prefix_from_storage():
    store = warm_store()
    engine, runner = make(store)  # fresh device and host pools, same store
    add(engine, "again", PROMPT)
    assert run(engine)["again"] == reference_tokens(PROMPT, 4, VOCAB)
    st = kv_of(engine).storage.stats
    assert st.hit_tokens == 92 and st.miss_tokens == 0 and st.prefetch_complete == 1
    assert kv_of(engine).tree.stats.host_hit_tokens == 92  # loaded back like a host hit
    assert runner.computed_tokens == 96 - 92 + 3  # last page + decode, not the prefix
    assert_host_pool_whole(engine)


def test_policies_hold_the_request_until_terminable():
    store = warm_store()
    store.delay = 3
    for policy, admitted_at, hit in (("wait_complete", 4, 92), ("best_effort", 1, 0),
                                     ("timeout", 4, 92)):
        engine, runner = make(store, policy=policy)
        add(engine, "r", PROMPT)
        steps = 0
        while not runner.steps or not runner.steps[-1].scheduled:
            engine.step()
            steps += 1
        assert steps - 1 == admitted_at, policy
        run(engine)
        assert kv_of(engine).storage.stats.hit_tokens == hit, policy
        assert_host_pool_whole(engine)


def test_timeout_policy_gives_up_after_the_timeout():
    store = warm_store()
    store.delay = 10_000  # a store that never answers in time
    engine, runner = make(store, extra='{"prefetch_threshold": 8, "prefetch_timeout_base": 5,'
                                       ' "prefetch_timeout_per_ki_token": 0}')
    now = [100.0]
    kv_of(engine).storage.clock = lambda: now[0]
    add(engine, "r", PROMPT)
    kv_of(engine).storage.prefetches[next(iter(kv_of(engine).storage.prefetches))].started_at = 100.0
    for _ in range(5):
        engine.step()
    assert not any(s.scheduled for s in runner.steps), "admitted before the timeout"
    now[0] = 105.0
    store.delay = 1  # the backups of the request's own pages may go through now
    got = run(engine)
    assert got["r"] == reference_tokens(PROMPT, 4, VOCAB)
    assert kv_of(engine).storage.stats.prefetch_partial == 1
    assert_host_pool_whole(engine)


def test_abort_during_prefetch_frees_its_host_pages():
    store = warm_store()
    store.delay = 5
    engine, _ = make(store, policy="wait_complete")
    add(engine, "r", PROMPT)
    engine.step()
    assert kv_of(engine).host_allocator.num_used() == 23
    engine.abort_request("r")
    run(engine)
    st = kv_of(engine).storage.stats
    assert st.prefetch_cancelled == 1 and st.hit_tokens == 0
    assert kv_of(engine).host_allocator.num_used() == 0
    assert_host_pool_whole(engine)


def test_below_threshold_is_revoked_and_corruption_is_a_miss():
    store = warm_store()
    engine, _ = make(store, extra='{"prefetch_threshold": 400}')  # more than the prompt
    add(engine, "r", PROMPT)
    assert run(engine)["r"] == reference_tokens(PROMPT, 4, VOCAB)
    assert kv_of(engine).storage.stats.hit_tokens == 0  # not even asked: below threshold
    # A record that fails its checks mid-prefix: the pages before it are used, the rest
    # recomputed, output unchanged.
    store.fail_get = {k for k in store.pages if k == sorted(store.pages)[0]}
    engine, _ = make(store)
    add(engine, "r", PROMPT)
    assert run(engine)["r"] == reference_tokens(PROMPT, 4, VOCAB)
    st = kv_of(engine).storage.stats
    assert st.prefetch_partial == 1 and st.hit_tokens < 92
    assert_host_pool_whole(engine)


def test_backup_pins_the_host_copy_until_it_ends():
    store = FakeStorage(delay=3)
    engine, _ = make(store)
    add(engine, "r", PROMPT, n=1)
    tree = kv_of(engine).tree
    while engine.scheduler.running or engine.scheduler.waiting or not tree.storage.backups:
        engine.step()
    pinned = [n for n in tree.nodes() if n.host_ref]
    assert pinned and all(n.host_pages for n in pinned)
    assert tree.evict(10**6) == 24  # the device copies go; the host copies stay
    assert tree.evict_host(10**6) == 0  # pinned: the backup still reads them
    run(engine)
    assert not any(n.host_ref for n in tree.nodes()) and len(store.pages) == 24
    assert tree.evict_host(10**6) == 24


def test_failed_backups_are_counted_never_acknowledged():
    store = FakeStorage(error_every=1)
    engine, _ = make(store)
    add(engine, "r", PROMPT)
    run(engine)
    st = kv_of(engine).storage.stats
    assert st.errors >= 1 and st.backup_failed_pages == 24 and st.backup_pages == 0
    assert not store.pages
    # a later engine on that store finds nothing and recomputes
    engine, runner = make(store)
    add(engine, "r2", PROMPT)
    assert run(engine)["r2"] == reference_tokens(PROMPT, 4, VOCAB)
    assert kv_of(engine).storage.stats.hit_tokens == 0


def test_graceful_shutdown_finishes_pending_backups():
    store = FakeStorage(delay=4)
    engine, _ = make(store)
    add(engine, "r", PROMPT, n=1)
    while engine.scheduler.running or engine.scheduler.waiting:
        engine.step()
    assert kv_of(engine).storage_backups_pending()
    assert engine.finish_storage_backups(timeout=5.0)
    assert len(store.pages) == 24


@pytest.mark.parametrize("bad", ['{"prefetch_threshold": -1}', '{"prefetch_timeout_max": "x"}'])
def test_bad_prefetch_config_names_the_key(bad):
    with pytest.raises(ValueError, match="prefetch_"):
        make(FakeStorage(), extra=bad)
    with pytest.raises(ValueError, match="--hicache-storage-prefetch-policy"):
        PrefetchConfig.from_extra("sometimes", {})
