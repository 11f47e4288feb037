"""Hybrid SWA memory across PD, the page side (cache/swa_pd.py): the decode's tail allocation
(SGLang's alloc_extend_swa_tail) and the SWA pages each side puts on the wire (the last window
only), with both pools whole afterwards."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvstrata.cache.kv_manager import KVManager
from kvstrata.cache.swa_pd import (decode_tail_wire_ids, grow_swa_tail, prefill_tail_wire_ids,
                                   swa_base, tail_start_page)
from kvstrata.config.kv_plan import KVPlan


def swa_kv(num_pages=64, num_swa=16, P=1, window=4):
    return KVManager(KVPlan.pages_only(num_pages=num_pages, page_size=P,
                                       num_swa_pages=num_swa, swa_window=window),
                     disable_radix_cache=True)


def req(rid="a"):
    return SimpleNamespace(rid=rid, pages=[], num_tree_pages=0, last_node=None,
                           num_computed_tokens=0, row_stale_from=0, all_ids=[])


@pytest.mark.parametrize("seq_len,window,P,first", [
    (100, 4, 1, 97), (100, 8, 16, 5), (100, 37, 16, 4), (3, 8, 1, 0), (16, 1, 16, 1),
    (17, 1, 16, 1)])
def test_tail_starts_at_the_first_position_the_next_query_reads(seq_len, window, P, first):
    assert tail_start_page(seq_len, window, P) == first
    # the first decode query (position seq_len) reads seq_len - W + 1 .. seq_len - 1
    assert first * P <= max(seq_len - window + 1, 0)


@pytest.mark.parametrize("P,seq_len,window", [(1, 100, 4), (16, 200, 20), (4, 10, 32)])
def test_decode_tail_grow_maps_only_the_last_window(P, seq_len, window):
    kv = swa_kv(num_pages=64 if P > 1 else 128, num_swa=8, P=P, window=window)
    r = req()
    assert grow_swa_tail(kv, r, seq_len)          # the SWA pool could not hold the prompt
    pages = -(-seq_len // P)
    first = tail_start_page(seq_len, window, P)
    assert len(r.pages) == pages and r.swa_evicted_pages == first
    assert [kv.swa.live(p) for p in r.pages] == [i >= first for i in range(pages)]
    wire = decode_tail_wire_ids(kv, r, seq_len)
    assert len(wire) == pages - first
    assert all(w > swa_base(kv.plan.num_pages) for w in wire)
    r.num_computed_tokens = seq_len                # the transfer filled it: now it decodes
    kv.swa.check_requests([r], kv.tree)
    kv.release(r, insert=False)
    assert kv.allocator.available_pages() == kv.allocator.num_pages
    assert kv.swa.allocator.available_pages() == kv.swa.allocator.num_pages


def test_tail_grow_is_all_or_nothing():
    kv = swa_kv(num_pages=16, num_swa=2, P=1, window=4)   # tail of 3 > 2 SWA pages
    r = req()
    assert not grow_swa_tail(kv, r, 10)
    assert not r.pages
    assert kv.allocator.available_pages() == 16 and kv.swa.allocator.available_pages() == 2
    kv2 = swa_kv(num_pages=8, num_swa=8, P=1, window=4)   # 10 full pages > 8
    assert not grow_swa_tail(kv2, req(), 10)
    assert kv2.swa.allocator.available_pages() == 8


def test_prefill_sends_the_live_tail_and_both_sides_agree_on_its_length():
    P, W, n = 4, 9, 50
    pre = swa_kv(num_pages=64, num_swa=64, P=P, window=W)
    r = req()
    assert pre.grow(r, n)                          # a co-located prefill: SWA for every page
    r.num_computed_tokens = n
    pre.free_out_of_window(r)                      # what the scheduler does each step
    sent = prefill_tail_wire_ids(pre, r, n)
    dec = swa_kv(num_pages=64, num_swa=8, P=P, window=W)
    d = req()
    assert grow_swa_tail(dec, d, n)
    assert len(sent) == len(decode_tail_wire_ids(dec, d, n)) == \
        -(-n // P) - tail_start_page(n, W, P)
    base = swa_base(pre.plan.num_pages)
    first = tail_start_page(n, W, P)
    assert sent == [base + pre.swa.map[p] for p in r.pages[first:]]


def test_prefill_refuses_a_tail_page_without_swa():
    kv = swa_kv(num_pages=64, num_swa=64, P=1, window=4)
    r = req()
    assert kv.grow(r, 20)
    kv.swa.free_swa(r.pages[17:18])                # a bug elsewhere dropped a window page
    with pytest.raises(AssertionError, match="no SWA page"):
        prefill_tail_wire_ids(kv, r, 20)
