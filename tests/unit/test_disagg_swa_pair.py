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


def test_the_decode_radix_cache_and_a_decode_host_pool_stay_refused_with_swa():
    SchedulerConfig(num_pages=64, num_swa_pages=16, swa_window=4,
                    disaggregation_mode="decode")                 # allowed now
    with pytest.raises(ValueError, match="decode radix cache"):
        SchedulerConfig(num_pages=64, num_swa_pages=16, swa_window=4,
                        disaggregation_mode="decode",
                        disaggregation_decode_enable_radix_cache=True)
