"""HiCache L3 with hybrid SWA memory end to end (cache/swa_storage.py): kvstrata.LLM on the
tiny windowed Qwen2 (layer 0 full, two layers with a window of 8) whose pages are stored as a
full record and, where the host copy has it, an SWA record, each under keys and a namespace
naming its component. Greedy tokens must equal a cold run on one uniform pool, which equals
transformers'; every KV invariant is checked after every step (KVSTRATA_CHECK_INTEGRITY) and
the pools are whole after the drain (check_integrity)."""
from __future__ import annotations

import json
import os

import pytest

from tests.correctness.test_hicache_engine import multi_turn
from tests.correctness.test_sliding_window_models import windowed  # noqa: F401 (fixture)
from tests.correctness.test_swa_memory_engine import llm

TURNS = dict(conversations=6, turns=3, system_len=20, user_len=6)
CAP = 1 << 30  # the file store's max_bytes: the two pool kinds' stores share it
L3 = dict(page_size=4, enable_hierarchical_cache=True, hicache_size=0,
          hicache_storage_prefetch_policy="wait_complete")


@pytest.fixture(scope="module")
def cold(windowed):
    """Multi-turn prompts and their tokens on one uniform pool, without HiCache; the last
    turn's (whose prompts hold every earlier turn) checked against transformers."""
    from helpers.compare import assert_match_transformers

    path = windowed["qwen2"]
    with llm(path, page_size=4, max_total_tokens=4096, disable_hybrid_swa_memory=True) as eng:
        prompts, expected = multi_turn(eng, **TURNS)
    last = -TURNS["conversations"]
    assert_match_transformers(path, prompts[last:], expected[last:],
                              label="uniform pool vs transformers")
    return prompts, expected


def generate(engine, prompts, cached=None):
    """Greedy answers in order; `cached` (a list) gets each prompt's cached tokens."""
    outs = [engine.generate(input_ids=p, sampling_params={
        "max_new_tokens": 6, "min_new_tokens": 6, "temperature": 0}) for p in prompts]
    if cached is not None:
        cached += [o["meta_info"]["cached_tokens"] for o in outs]
    return [o["output_ids"] for o in outs]


def storage_config(backend, tmp_path, mooncake):
    extra = {"prefetch_threshold": 8}
    if backend == "file":
        extra.update(file_path=str(tmp_path), max_bytes=CAP)
    else:
        extra.update(master_server_address=mooncake.address, protocol="tcp",
                     metadata_server="P2PHANDSHAKE", local_hostname="127.0.0.1",
                     global_segment_size=64 << 20, local_buffer_size=16 << 20)
    return dict(hicache_storage_backend=backend,
                hicache_storage_backend_extra_config=json.dumps(extra))


@pytest.fixture(scope="module")
def mooncake():
    """A mooncake_master of the module's own (stopped by pid), or a skip naming why."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        pytest.skip(f"mooncake client not importable: {e}")
    from kvstrata.kv.storage.mooncake_master import MooncakeMaster
    with MooncakeMaster() as master:
        yield master


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_restarted_engine_serves_prefixes_from_storage(backend, windowed, cold, tmp_path,
                                                       request):
    """A first engine answers every turn and backs its pages up; a second one with fresh
    device and host pools over the same store reads each conversation's longest prefix from
    storage (both halves: the window before the match end comes back with its SWA pages),
    with the cold run's tokens. A uniform-pool engine on the same file store finds none of
    those records (another namespace, other keys) and still answers exactly. (Mooncake keeps
    pages in the clients' memory: the first engine stays up while the second reads.)"""
    prompts, expected = cold
    mc = request.getfixturevalue("mooncake") if backend == "mooncake" else None
    kw = dict(L3, max_total_tokens=4096, hicache_ratio=2.0,
              **storage_config(backend, tmp_path, mc))
    path = windowed["qwen2"]
    last = prompts[-TURNS["conversations"]:]
    with llm(path, **kw) as first:
        info = first.server_info()  # /server_info: the SWA pool stays on beside L3
        assert info["kv_plan"]["pool_kind"] == "swa"
        assert {r["field"]: r["rule"] for r in info["resolutions"]}["hybrid_swa_memory"] \
            == "swa.on"
        assert generate(first, prompts) == expected
        assert first.engine.finish_storage_backups(timeout=30)
        written = first.get_load()
        assert written["hicache_storage_swa_pages_written"] > 0, written
        if backend == "file":  # by page bytes: one full layer, two windowed ones
            caps = written["hicache_storage_max_bytes"], written["hicache_storage_swa_max_bytes"]
            assert abs(CAP - sum(caps)) <= 1 and abs(2 * caps[0] - caps[1]) <= 2, caps
        # (the uniform pool's check once: namespaces and keys are the backend's business)
        for swa in (False, True) if backend == "file" else (True,):
            cached = []
            with llm(path, **kw, disable_hybrid_swa_memory=not swa) as second:
                assert generate(second, last, cached) == expected[-len(last):]
                load = second.get_load()
                second.check_integrity()
            hit = load["hicache_storage_hit_tokens"]
            if swa:  # all but the last page of each prompt: storage, then the shared head
                assert cached == [(len(p) - 1) // 4 * 4 for p in last], (cached, load)
                # (The first restore read the SWA records of its own end's window only, so
                # the shared head's window is dead for the others: their fetches start a
                # window early, and bring their own ends' windows, so that was for nothing.)
                assert load["hicache_storage_swa_lead_unused_pages"] > 0, load
                assert hit > len(last[0]) // 2 and load["hicache_host_hit_tokens"] == hit, load
                assert load["hicache_storage_swa_pages_read"] > 0, load
            else:
                assert hit == 0 and load["hicache_storage_pages_read"] == 0, load
        first.check_integrity()
    if backend == "file":  # one namespace per pool kind; the uniform pool's apart
        names = sorted(os.listdir(tmp_path))
        assert len(names) == 3 and sum("-full-" in n for n in names) == 1 \
            and sum("-swa-" in n for n in names) == 1, names


def test_starved_host_pool_brings_prefixes_back_from_storage(windowed, cold):
    """Device pool 64 full / 32 SWA tokens, host pool twice that: six conversations do not
    fit the host tier, so some turns' prefixes come back from the memory store (full records
    and the window's SWA records), are loaded back to the device, and the tokens equal the
    cold run's."""
    prompts, expected = cold
    with llm(windowed["qwen2"], **L3, max_total_tokens=64, swa_full_tokens_ratio=0.5,
             chunked_prefill_size=16, hicache_ratio=2.0, hicache_storage_backend="memory",
             hicache_storage_backend_extra_config='{"prefetch_threshold": 8}') as engine:
        assert multi_turn(engine, **TURNS) == (prompts, expected)
        load = engine.get_load()
        assert load["hicache_storage_hit_tokens"] > 0 and load["hicache_storage_errors"] == 0, load
        assert load["hicache_storage_swa_pages_read"] > 0, load
        assert load["hicache_host_hit_tokens"] >= load["hicache_storage_hit_tokens"], load
        engine.check_integrity()
