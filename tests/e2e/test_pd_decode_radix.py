"""The PD decode radix cache (--disaggregation-decode-enable-radix-cache) under pressure and
faults, its host tier and the decode KV offload, real servers, two pairs for the file (each
test leaves its pair drained):
  - `radix` (tcp): the decode radix cache in a 256-token pool. Conversations whose cached prefixes
    the decode server must evict are answered exactly as a co-located server, the evicted
    pages re-sent; an abort mid-turn and a prefill killed mid-turn leave the decode tree and
    pool whole, and the next turn hits the tree again.
  - `offload` (mooncake): the same pool with a host tier behind the tree and the KV offload
    to a file store the prefill server reads too: evicted prefixes come back from the host;
    a restarted prefill reads the whole previous turn the decode server stored."""
from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from tests.e2e.pd_servers import PDServers, assert_no_leak, pd_router, serving
from tests.e2e.test_routes_and_disconnect import kv_state

RADIX = "--disaggregation-decode-enable-radix-cache"
NEW = 8


def _colocated(server, ids: list[int], new: int = NEW) -> list[int]:
    return httpx.post(server.base_url + "/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0.0}},
        timeout=60).json()["output_ids"]


def _turn(pd: PDServers, server, ids: list[int], label: str) -> tuple[list[int], int]:
    """One turn through both servers, checked against the co-located answer; returns the
    output and the decode server's prefix-hit tokens for it."""
    before = kv_state(pd.decode)["disagg_decode_prefix_hit_tokens_total"]
    prefill, decode = pd.generate(ids, max_new_tokens=NEW)
    assert (prefill.status_code, decode.status_code) == (200, 200), decode.text
    out = decode.json()["output_ids"]
    assert out == _colocated(server, ids), label
    return out, kv_state(pd.decode)["disagg_decode_prefix_hit_tokens_total"] - before


@pytest.fixture(scope="module")
def radix(tiny_model_path, tcp_prefill):
    """On the session's plain tcp prefill (tests/e2e/conftest.py, shared with
    test_pd_disagg.py and test_pd_retraction.py): only the decode server is this file's."""
    tcp_prefill.revive_prefill()
    with serving(PDServers(tiny_model_path, "tcp", RADIX, "--max-total-tokens", "256",
                           shared_prefill=tcp_prefill)) as pd:
        yield pd


@pytest.fixture(scope="module")
def offload(tiny_model_path, tmp_path_factory):
    store = json.dumps({"file_path": str(tmp_path_factory.mktemp("l3")),
                        "prefetch_threshold": 16})
    prefill_args = ("--enable-hierarchical-cache", "--hicache-ratio", "2",
                    "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy",
                    "wait_complete", "--hicache-storage-backend-extra-config", store)
    # SGLang's spelling of the host tier switch, beside the offload (which implies it).
    with serving(PDServers(tiny_model_path, "mooncake", "--disaggregation-decode-enable-hicache",
                           "--disaggregation-decode-enable-offload-kvcache",
                           "--hicache-storage-backend", "file",
                           "--hicache-storage-backend-extra-config", store,
                           "--hicache-ratio", "4", "--max-total-tokens", "256",
                           prefill_args=prefill_args)) as pd:
        yield pd


def _load(srv) -> dict:
    load = httpx.get(srv.base_url + "/get_load", timeout=30).json()
    return load[0] if isinstance(load, list) else load


def _four_chats(pd: PDServers, server, seed: int) -> tuple[int, int]:
    """Four 3-turn conversations of ~70 tokens each through the 256-token decode pool, then
    the first one's 4th turn: (its prefix-hit tokens, the whole pages it held before)."""
    rng = random.Random(seed)
    chats = [[rng.randrange(100, 40000) for _ in range(30)] for _ in range(4)]
    held = {}
    for c in range(4):
        for turn in range(3):
            out, hit = _turn(pd, server, chats[c], f"chat {c} turn {turn}")
            if turn:
                assert hit > 0, (c, turn)
            held[c] = (len(chats[c]) + NEW - 1) // 4 * 4
            chats[c] = chats[c] + out + [rng.randrange(100, 40000) for _ in range(6)]
    st = kv_state(pd.decode)
    assert st["ok"], st
    assert st["num_cached_tokens"] <= 256
    _, hit = _turn(pd, server, chats[0], "chat 0 turn 4")
    assert_no_leak(pd.decode)
    assert_no_leak(pd.prefill)
    return hit, held[0]


def test_evicted_prefixes_are_resent_exactly(radix, server):
    """The first conversation's 4th turn finds (part of) its prefix evicted: fewer hit tokens
    than it held, the rest re-sent, the answer exact."""
    hit, held = _four_chats(radix, server, 3)
    assert hit < held, (hit, held)  # evicted by the later chats, re-sent


def test_abort_and_killed_prefill_mid_turn_keep_the_tree_whole(radix, server):
    pd = radix
    assert httpx.post(pd.decode.base_url + "/flush_cache", timeout=30).status_code == 200
    rng = random.Random(5)
    ids = [rng.randrange(100, 40000) for _ in range(41)]
    out, _ = _turn(pd, server, ids, "turn 1")
    ids = ids + out + [rng.randrange(100, 40000) for _ in range(5)]
    cached = kv_state(pd.decode)["num_cached_tokens"]
    assert cached > 0
    # An abort while turn 2 decodes (a long answer), on the decode server.
    body = {"input_ids": ids, "rid": "long", "sampling_params": {
        "max_new_tokens": 100, "temperature": 0.0, "ignore_eos": True}, **pd.body()}
    answers = {}
    threads = [threading.Thread(target=lambda s=s, n=n: answers.__setitem__(
        n, httpx.post(s.base_url + "/generate", json=body, timeout=120).status_code))
        for n, s in (("prefill", pd.prefill), ("decode", pd.decode))]
    for t in threads:
        t.start()
    time.sleep(1.0)
    httpx.post(pd.decode.base_url + "/abort_request", json={"rid": "long"}, timeout=30)
    for t in threads:
        t.join()
    assert answers["decode"] != 500, answers
    assert_no_leak(pd.decode)
    assert kv_state(pd.decode)["num_cached_tokens"] >= cached  # the tree kept turn 1
    # The prefill killed while turn 2 waits for it: the decode side fails that turn only,
    # and its tree still serves the next attempt once a prefill is back.
    pd.prefill.stop(sig=9)
    r = httpx.post(pd.decode.base_url + "/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0},
        **pd.body()}, timeout=120)
    assert r.status_code == 500, r.text
    assert_no_leak(pd.decode)
    assert kv_state(pd.decode)["num_cached_tokens"] >= cached
    pd.prefill = pd.start_prefill(port=pd.prefill.port)
    _, hit = _turn(pd, server, ids, "turn 2 after the restart")
    assert hit >= (41 + NEW - 1) // 4 * 4, hit  # turn 1's pages, still in the tree
    assert_no_leak(pd.decode)
    assert_no_leak(pd.prefill)


def test_decode_host_tier_keeps_evicted_prefixes(offload, server):
    """The same chats with a host tier behind the decode tree: pages evicted from the
    device stay on the host and are loaded back at the 4th turn's admission, so it hits
    everything it held; answers exact; retraction backups are cpu_tensor (the rule: an
    explicit host_pool backup and the offload are mutually exclusive, as in SGLang)."""
    info = httpx.get(offload.decode.base_url + "/server_info", timeout=30).json()
    assert info["enable_hierarchical_cache"] is True
    assert info["disaggregation_decode_enable_radix_cache"] is True  # the offload's rule
    assert info["kv_plan"]["host_pool_use"] == "hicache"
    assert info["disaggregation_decode_retraction_backup"] == "cpu_tensor"
    hit, held = _four_chats(offload, server, 3)
    assert hit >= held, (hit, held)
    load = _load(offload.decode)
    assert load["hicache_host_hit_tokens"] > 0 and load["hicache_h2d_pages"] > 0, load
    assert load["hicache_d2h_pages"] > 0, load  # finished requests written through


def test_decode_offload_feeds_a_restarted_prefill(offload, server):
    """The decode server wrote each finished request's pages (prompt and output) to the L3
    store through its host tier. A prefill server restarted on that store (empty device and
    host tiers) reads the whole previous turn from storage -- more than the prompt it
    computed itself."""
    pd = offload
    rng = random.Random(9)
    ids = [rng.randrange(100, 40000) for _ in range(41)]
    out, _ = _turn(pd, server, ids, "turn 1")
    whole = (len(ids) + NEW - 1) // 4 * 4  # the pages the decode server finished with
    deadline = time.monotonic() + 30
    while _load(pd.decode).get("hicache_storage_backup_pages", 0) * 4 < whole:
        assert time.monotonic() < deadline, _load(pd.decode)
        time.sleep(0.2)
    pd.prefill.stop()
    # A fresh prefill on the same ports: the decode server, whose route to the old one
    # went quiet, looks it up again, so the first request after the restart succeeds.
    pd.prefill = pd.start_prefill(port=pd.prefill.port)
    ids = ids + out + [rng.randrange(100, 40000) for _ in range(5)]
    prefill, decode = pd.generate(ids, max_new_tokens=NEW)
    assert (prefill.status_code, decode.status_code) == (200, 200), decode.text
    assert decode.json()["output_ids"] == _colocated(server, ids)
    read = _load(pd.prefill)["hicache_storage_hit_tokens"]
    assert read >= whole > len(ids[:41]) // 4 * 4, (read, whole)
    assert_no_leak(pd.decode)
    assert_no_leak(pd.prefill)


def _router_chat(pd: PDServers, server, seed: int, first_len: int, turns: int) -> None:
    """A conversation through sglang-router in front of `pd`: every turn answers as the
    co-located server, and every turn after the first hits the decode tree."""
    with pd_router(pd) as router:
        rng = random.Random(seed)
        ids = [rng.randrange(100, 40000) for _ in range(first_len)]
        for turn in range(turns):
            before = kv_state(pd.decode)["disagg_decode_prefix_hit_tokens_total"]
            r = httpx.post(router.base_url + "/generate", json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": NEW,
                                                      "temperature": 0.0}}, timeout=60)
            assert r.status_code == 200, r.text
            out = r.json()["output_ids"]
            assert out == _colocated(server, ids), turn
            hit = kv_state(pd.decode)["disagg_decode_prefix_hit_tokens_total"] - before
            assert (hit > 0) == (turn > 0), (turn, hit)
            ids = ids + out + [rng.randrange(100, 40000) for _ in range(5)]
        assert_no_leak(pd.decode)


def test_turns_through_sglang_router_hit_the_decode_tree(radix, server):
    """sglang-router in PD mode in front of the radix pair (tcp): a 3-turn conversation
    answers as the co-located server, and turns 2 and 3 hit the decode tree (only new pages
    cross)."""
    _router_chat(radix, server, seed=13, first_len=33, turns=3)


def test_turns_through_sglang_router_over_mooncake(offload, server):
    """The router in front of the mooncake pair: a 2-turn chat answers as the co-located
    server and turn 2 hits the decode tree (its host tier behind it)."""
    _router_chat(offload, server, seed=17, first_len=29, turns=2)
