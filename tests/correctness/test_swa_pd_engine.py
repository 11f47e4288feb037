"""Hybrid SWA memory across PD with real runners, in one process: a prefill and a decode
EngineCore (the server's engine factory, --disaggregation-mode prefill / decode, the tcp
backend on 127.0.0.1) over a tiny windowed checkpoint, stepped in turn. Greedy tokens must
equal transformers' and the co-located engine's; the decode's SWA pool is smaller than the
prompts' total, so it only serves them by taking SWA pages for each prompt's last window;
the SWA pages that crossed are counted per room; a decode whose full pool is pressured
retracts (cpu_tensor, and the auto rule's host_pool: the live window's SWA pages backed up
too) and restores exactly. Every
KV invariant is checked after every step (KVSTRATA_CHECK_INTEGRITY, tests/conftest.py)."""
from __future__ import annotations

import json

import pytest

from kvstrata.cache import swa_pd
from kvstrata.config.server_args import ServerArgs
from kvstrata.engine.request import EngineRequest
from kvstrata.engine.sides.registry import pd_side
from kvstrata.entrypoints.engine_factory import build_engine
from kvstrata.protocol import SamplingParams
from kvstrata.protocol.disagg import BootstrapAddr
from tests.correctness.test_sliding_window_models import (  # noqa: F401 (fixtures)
    GREEDY, NEW_TOKENS as NEW, WINDOW, check, prompts, references, windowed)
from tests.helpers.compare import assert_match_transformers
from tests.correctness.test_swa_memory_engine import llm
from tests.helpers.ports import free_port


@pytest.fixture(autouse=True)
def short_bootstrap(monkeypatch):
    """A room the decode never admits fails in seconds here, not after 300 s."""
    monkeypatch.setenv("KVSTRATA_DISAGG_BOOTSTRAP_TIMEOUT", "20")


def engine(path, mode, port, page_size, **kw):
    kw.setdefault("disaggregation_transfer_backend", "tcp")
    args = ServerArgs(model_path=path, skip_tokenizer_init=True, dtype="float32",
                      disable_hybrid_swa_memory=False, disaggregation_mode=mode,
                      disaggregation_bootstrap_port=port, page_size=page_size,
                      max_running_requests=8, **kw)
    return build_engine(args)[0]


def run_pair(prefill, decode, prompts, port, max_steps=20_000, room_base=500, params=None):
    """`params`: the sampling params dict (GREEDY when None)."""
    outs = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        for eng in (prefill, decode):
            eng.add_request(EngineRequest(str(i), list(p), SamplingParams(**(params or GREEDY)),
                                          bootstrap=BootstrapAddr("127.0.0.1", port,
                                                                  room_base + i)))
    for _ in range(max_steps):
        if not (prefill.has_unfinished_requests() or decode.has_unfinished_requests()):
            break
        prefill.step()
        for o in decode.step():
            assert o.finish_reason is None or o.finish_reason.type != "abort", o.finish_reason
            outs[int(o.rid)] += o.new_token_ids
    else:
        raise AssertionError("PD pair not drained:\n" + decode.dump_state())
    return [outs[i] for i in range(len(prompts))]


def assert_bytes_crossed(prefill, decode, want: int) -> None:
    """Both sides' byte counters say exactly `want` bytes of KV crossed."""
    assert pd_side(decode.scheduler).load()["disagg_kv_bytes_received_total"] == want
    assert pd_side(prefill.scheduler).load()["disagg_kv_bytes_sent_total"] == want


def swa_whole(eng):
    eng.check_integrity()
    kv = eng.scheduler.kv
    assert kv.swa is not None, "hybrid SWA memory is off"
    alloc = kv.swa.allocator
    assert alloc.available_pages() + kv.tree.cached_swa_pages() == alloc.num_pages


@pytest.mark.parametrize("page_size", [1, 16])
def test_pd_greedy_equals_transformers_and_colocated(page_size, windowed, prompts, references,
                                                     monkeypatch):
    path = windowed["qwen2"]                      # layer 0 full attention, the rest windowed
    sent = []
    tail = swa_pd.prefill_tail_wire_ids
    monkeypatch.setattr("kvstrata.engine.sides.disagg_prefill.prefill_tail_wire_ids",
                        lambda kv, req, n: sent.append((n, tail(kv, req, n))) or sent[-1][1])
    port = free_port()
    prefill = engine(path, "prefill", port, page_size, max_total_tokens=2048)
    # decode: an SWA pool below the prompts' total tokens (about 20% of the full pool)
    decode = engine(path, "decode", free_port(), page_size, max_total_tokens=1024,
                    swa_full_tokens_ratio=0.1)
    try:
        assert decode.scheduler.kv.swa.allocator.num_pages * page_size < sum(map(len, prompts))
        outs = run_pair(prefill, decode, prompts, port)
        check(outs, references["qwen2"], f"PD P={page_size}")
        colocated = llm(path, page_size=page_size, max_total_tokens=2048)
        try:
            assert outs == [o["output_ids"] for o in
                            colocated.generate(input_ids=prompts, sampling_params=GREEDY)]
        finally:
            colocated.shutdown()
        # only the last window's SWA pages were sent, for every prompt
        assert sorted(n for n, _ in sent) == sorted(map(len, prompts))
        for n, ids in sent:
            assert len(ids) == -(-n // page_size) - swa_pd.tail_start_page(n, WINDOW, page_size)
            assert len(ids) <= -(-WINDOW // page_size) + 1
        # the byte counters: full pages at the full pool's page bytes, SWA pages at the SWA's
        plan = decode.scheduler.config.plan
        full_bytes, swa_bytes = plan.bytes_per_page, pd_side(decode.scheduler).swa_page_bytes
        assert 0 < swa_bytes < full_bytes * 4
        want = sum(-(-n // page_size) * full_bytes + len(ids) * swa_bytes for n, ids in sent)
        assert_bytes_crossed(prefill, decode, want)
        for eng in (prefill, decode):
            swa_whole(eng)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("backup", ["cpu_tensor", None])
def test_pressured_pd_decode_retracts_and_restores_exactly(backup, windowed, prompts,
                                                           references):
    """None: the auto rule's pick for a hybrid SWA pool, host_pool (full pages in the host
    pool, the live window's SWA pages in its SWA half; --hicache-ratio 2: room for every
    backup, the default 0.2 would abort some, as SGLang's does)."""
    path, port = windowed["qwen2"], free_port()
    prefill = engine(path, "prefill", port, 1, max_total_tokens=2048)
    decode = engine(path, "decode", free_port(), 1, max_total_tokens=200, swa_full_tokens_ratio=0.5,
                    num_reserved_decode_tokens=1,
                    disaggregation_decode_retraction_backup=backup,
                    hicache_ratio=None if backup else 2.0)
    want = backup or "host_pool"
    try:
        outs = run_pair(prefill, decode, prompts, port)
        check(outs, references["qwen2"], f"PD retracted ({want})")
        side = pd_side(decode.scheduler)
        assert decode.scheduler.config.retraction_backup == want
        assert side.retraction.num_backups[want] >= 1
        assert side.retraction.num_restores[want] == side.retraction.num_backups[want]
        stats = decode.runner.backup.swa.stats()  # the window's SWA pages went along
        assert stats[f"{want}_backup_count"] == stats[f"{want}_restore_count"] >= 1
        for eng in (prefill, decode):
            swa_whole(eng)
        if want == "host_pool":
            kv = decode.scheduler.kv
            assert kv.host_allocator.available_pages() == kv.host_allocator.num_pages
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_pd_with_an_eagle_head(windowed, prompts, references, tmp_path):
    """A draft model on both sides of the pair, beside the SWA pools: the receive's page ids
    also name the last window's SWA pages (wire ids past the full pool's), which the draft
    must not take for its own slots (standalone.py `received_full_pages`, which a STANDALONE
    draft goes through too); an EAGLE head's KV crosses with the full pages and its first
    round starts from the prefill's state. Transformers' tokens."""
    from tests.helpers.eagle_heads import random_head

    path, port = windowed["qwen2"], free_port()
    spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=3,
                speculative_draft_model_path=random_head(path, str(tmp_path / "head"))[0],
                speculative_disable_by_batch_size=1 << 20)
    prefill = engine(path, "prefill", port, 16, max_total_tokens=2048, **spec)
    decode = engine(path, "decode", free_port(), 16, max_total_tokens=1024,
                    swa_full_tokens_ratio=0.3, **spec)
    try:
        outs = run_pair(prefill, decode, prompts, port)
        check(outs, references["qwen2"], "PD EAGLE")
        assert decode.runner.draft.handoffs_used > 0
        for eng in (prefill, decode):
            swa_whole(eng)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.fixture(scope="module")
def prefill4(windowed):
    """One prefill server (page size 4) for the decode-feature tests: (engine, port)."""
    port = free_port()
    eng = engine(windowed["qwen2"], "prefill", port, 4, max_total_tokens=2048)
    yield eng, port
    eng.shutdown()


def test_decode_radix_cache_hits_move_only_the_delta(windowed, prompts, references, prefill4):
    """--disaggregation-decode-enable-radix-cache over the SWA radix cache: second turns
    (each prompt, its answer, a short or a longer new message) hit the decode's tree, whose
    live window before the match end serves the new last window's first pages; only the delta's full pages and its SWA pages past the prefix
    cross (the byte counters, both sides, say exactly that); transformers' answers."""
    path, P = windowed["qwen2"], 4
    prefill, port = prefill4
    decode = engine(path, "decode", free_port(), P, max_total_tokens=2048,
                    disaggregation_decode_enable_radix_cache=True)
    try:
        firsts = run_pair(prefill, decode, prompts, port)
        check(firsts, references["qwen2"], "PD radix turn 1")
        side, kv = pd_side(decode.scheduler), decode.scheduler.kv
        turns = [(p, p + out + [7, 11, 13][:1 + i % 3] + [5] * (9 * (i % 2)))
                 for i, (p, out) in enumerate(zip(prompts, firsts)) if len(p) >= 9]
        follow = [ids for _, ids in turns]
        held = [kv.peek_prefix_len(ids, whole_prompt=True) for ids in follow]
        # every whole page of each first turn but its last token's (never computed here)
        assert held == [(len(p) + NEW - 1) // P * P for p, _ in turns]
        plan = decode.scheduler.config.plan
        full_bytes, swa_bytes = plan.bytes_per_page, side.swa_page_bytes
        before = (side.load()["disagg_kv_bytes_received_total"],
                  pd_side(prefill.scheduler).load()["disagg_kv_bytes_sent_total"])
        hits = side.prefix_hit_tokens
        outs = run_pair(prefill, decode, follow, port, room_base=700)
        assert_match_transformers(path, follow, outs, "PD radix turn 2")
        assert side.prefix_hit_tokens - hits == sum(held)
        want, overlap = 0, 0
        for ids, h in zip(follow, held):
            n, k = -(-len(ids) // P), h // P
            first = swa_pd.tail_start_page(len(ids), WINDOW, P)
            want += (n - k) * full_bytes + (n - max(first, k)) * swa_bytes
            overlap += k > first
        assert overlap, "no follow-up's last window started inside its cached prefix"
        assert side.load()["disagg_kv_bytes_received_total"] - before[0] == want
        assert pd_side(prefill.scheduler).load()["disagg_kv_bytes_sent_total"] - before[1] \
            == want
        for eng in (prefill, decode):
            swa_whole(eng)
    finally:
        decode.shutdown()


def _file_store(tmp_path) -> dict:
    extra = {"file_path": str(tmp_path), "prefetch_threshold": 4}
    return dict(hicache_storage_backend="file",
                hicache_storage_backend_extra_config=json.dumps(extra))


@pytest.mark.parametrize("tier", ["host_pool_backups", "offload"])
def test_decode_hicache_with_a_starved_pool(tier, windowed, prompts, references, prefill4,
                                            tmp_path):
    """Decode HiCache over the SWA HiRadix cache: a decode device pool of 120 full / 60 SWA
    tokens demotes the cached first turns to the host (both halves) and second turns load
    them back (the window's SWA pages mapped to new full pages) and retract; transformers'
    tokens, every pool whole. `host_pool_backups`: the retraction backups in the same host
    pool. `offload`: --disaggregation-decode-enable-offload-kvcache (backups cpu_tensor, as
    the rule says beside it): the decode's host tier also backs every finished request up
    to a file store -- full records for every page, SWA records for the pages whose window
    K/V the decode held (the received last window, its own answer) -- and a fresh prefill
    server on that store reads each whole previous turn from it, more than any prefill
    computed, with transformers' third-turn tokens."""
    path, P = windowed["qwen2"], 4
    prefill, port = prefill4
    offload = tier == "offload"
    kw = (dict(disaggregation_decode_enable_offload_kvcache=True, **_file_store(tmp_path))
          if offload else dict(disaggregation_decode_enable_radix_cache=True,
                               disaggregation_decode_enable_hicache=True,
                               disaggregation_decode_retraction_backup="host_pool"))
    backup = "cpu_tensor" if offload else "host_pool"
    decode = engine(path, "decode", free_port(), P, max_total_tokens=120,
                    swa_full_tokens_ratio=0.5, num_reserved_decode_tokens=1,
                    hicache_ratio=8.0, **kw)
    try:
        assert decode.scheduler.kv.hicache and decode.scheduler.kv.swa is not None
        assert decode.scheduler.config.retraction_backup == backup
        firsts = run_pair(prefill, decode, prompts, port, room_base=800)
        check(firsts, references["qwen2"], "PD decode HiCache turn 1")
        follow = [p + out + [7, 11, 13] for p, out in zip(prompts, firsts) if len(p) >= 9]
        outs = run_pair(prefill, decode, follow, port, room_base=900)
        assert_match_transformers(path, follow, outs, "PD decode HiCache turn 2")
        load = decode.get_load()
        assert load["hicache_demoted_pages"] > 0 and load["hicache_host_hit_tokens"] > 0, load
        side = pd_side(decode.scheduler)
        assert side.prefix_hit_tokens > 0
        backups = side.retraction.num_backups[backup]
        assert backups >= 1 and side.retraction.num_restores[backup] == backups
        assert decode.runner.backup.swa.stats()[f"{backup}_restore_count"] >= 1
        if offload:
            _restarted_prefill_reads_the_decode_store(decode, path, follow, outs, tmp_path)
        for eng in (prefill, decode):
            swa_whole(eng)
    finally:
        decode.shutdown()


def _restarted_prefill_reads_the_decode_store(decode, path, follow, outs, tmp_path):
    assert decode.finish_storage_backups(timeout=30)
    load = decode.get_load()
    assert load["hicache_storage_backup_pages"] > 0, load
    assert load["hicache_storage_swa_pages_written"] > 0, load
    # (the third turns that fit the 120-token decode pool with their answers)
    turns = [(ids, out) for ids, out in zip(follow, outs) if len(ids) + 2 * NEW + 2 <= 110]
    assert len(turns) >= 2
    third = [ids + out + [17, 19] for ids, out in turns]
    stored = sum((len(ids) + NEW - 1) // 4 * 4 for ids, _ in turns)  # turn 2's whole pages
    port = free_port()
    fresh = engine(path, "prefill", port, 4, max_total_tokens=2048,
                   enable_hierarchical_cache=True, hicache_ratio=2.0,
                   hicache_storage_prefetch_policy="wait_complete", **_file_store(tmp_path))
    try:
        got = run_pair(fresh, decode, third, port, room_base=1000)
        assert_match_transformers(path, third, got, "PD turn 3 from the decode's store")
        read = fresh.get_load()
        assert read["hicache_storage_hit_tokens"] >= stored, (read, stored)
        assert read["hicache_storage_swa_pages_read"] > 0, read
        swa_whole(fresh)
    finally:
        fresh.shutdown()


@pytest.mark.parametrize("backend,page_size", [("tcp", 1), ("mooncake", 4)])
def test_pd_with_an_all_swa_model(windowed, prompts, references, backend, page_size):
    """An all-SWA model (every layer windowed: no full pool, its full page ids are addresses
    only) under PD: the full region is zero-byte pages, the last window's SWA pages cross
    (start-up failed on the missing full pool before); transformers' tokens."""
    path, port = windowed["mistral"], free_port()
    kw = dict(disaggregation_transfer_backend=backend)
    prefill = engine(path, "prefill", port, page_size, max_total_tokens=2048, **kw)
    decode = engine(path, "decode", free_port(), page_size, max_total_tokens=1024, **kw)
    try:
        assert decode.runner.kv_pool is None and decode.runner.swa_pool is not None
        check(run_pair(prefill, decode, prompts, port), references["mistral"], "PD all-SWA")
        for eng in (prefill, decode):
            swa_whole(eng)
    finally:
        prefill.shutdown()
        decode.shutdown()
