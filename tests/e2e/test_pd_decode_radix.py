"""The PD decode radix cache (--disaggregation-decode-enable-radix-cache) under pressure and
faults, real servers over tcp: conversations whose cached prefixes the decode server must
evict are answered exactly as a co-located server, the evicted pages are re-sent; an abort
mid-turn and a prefill killed mid-turn leave the decode tree and pool whole, and the next
turn hits the tree again."""
from __future__ import annotations

import json
import random
import threading
import time

import httpx

from tests.e2e.pd_servers import PDServers, assert_no_leak
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


def _four_chats(pd: PDServers, server) -> tuple[int, int]:
    """Four 3-turn conversations of ~100 tokens each through a 256-token decode pool, then
    the first one's 4th turn: (its prefix-hit tokens, the whole pages it held before)."""
    if True:
        rng = random.Random(3)
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


def test_evicted_prefixes_are_resent_exactly(tiny_model_path, server):
    """The first conversation's 4th turn finds (part of) its prefix evicted: fewer hit tokens
    than it held, the rest re-sent, the answer exact."""
    pd = PDServers(tiny_model_path, "tcp", RADIX, "--max-total-tokens", "256")
    try:
        hit, held = _four_chats(pd, server)
        assert hit < held, (hit, held)  # evicted by the later chats, re-sent
    finally:
        pd.stop()


def test_decode_host_tier_keeps_evicted_prefixes(tiny_model_path, server):
    """The same chats with a host tier behind the decode tree (SGLang's spelling of the
    switch): pages evicted from the device stay on the host and are loaded back at the
    4th turn's admission, so it hits everything it held; answers exact; retraction backups
    are cpu_tensor (the host pool is HiCache's)."""
    pd = PDServers(tiny_model_path, "tcp", RADIX, "--disaggregation-decode-enable-hicache",
                   "--hicache-ratio", "4", "--max-total-tokens", "256")
    try:
        info = httpx.get(pd.decode.base_url + "/server_info", timeout=30).json()
        assert info["enable_hierarchical_cache"] is True
        assert info["kv_plan"]["host_pool_use"] == "hicache"
        assert info["disaggregation_decode_retraction_backup"] == "cpu_tensor"
        hit, held = _four_chats(pd, server)
        assert hit >= held, (hit, held)
        load = httpx.get(pd.decode.base_url + "/get_load", timeout=30).json()
        load = load[0] if isinstance(load, list) else load
        assert load["hicache_host_hit_tokens"] > 0 and load["hicache_h2d_pages"] > 0, load
        assert load["hicache_d2h_pages"] > 0, load  # finished requests written through
    finally:
        pd.stop()


def test_abort_and_killed_prefill_mid_turn_keep_the_tree_whole(tiny_model_path, server):
    pd = PDServers(tiny_model_path, "tcp", RADIX)
    try:
        rng = random.Random(5)
        ids = [rng.randrange(100, 40000) for _ in range(41)]
        out, _ = _turn(pd, server, ids, "turn 1")
        ids = ids + out + [rng.randrange(100, 40000) for _ in range(5)]
        cached = kv_state(pd.decode)["num_cached_tokens"]
        assert cached > 0
        # An abort while turn 2 decodes (a long answer), on the decode server.
        body = {"input_ids": ids, "rid": "long", "sampling_params": {
            "max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}, **pd.body()}
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
        # The prefill killed while turn 2 waits for it: the decode side fails that turn
        # only, and its tree still serves the next attempt once a prefill is back.
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
    finally:
        pd.stop()


def _load(srv) -> dict:
    load = httpx.get(srv.base_url + "/get_load", timeout=30).json()
    return load[0] if isinstance(load, list) else load


def test_decode_offload_feeds_a_restarted_prefill(tiny_model_path, server, tmp_path):
    """--disaggregation-decode-enable-offload-kvcache: the decode server writes each finished
    request's pages (prompt and output) to the L3 store through its tree's host tier. A
    prefill server restarted on the same store (empty device and host tiers) then reads the
    whole previous turn from storage -- more than the prompt it computed itself."""
    store = json.dumps({"file_path": str(tmp_path), "prefetch_threshold": 16})
    prefill_args = ("--enable-hierarchical-cache", "--hicache-ratio", "2",
                    "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy",
                    "wait_complete", "--hicache-storage-backend-extra-config", store)
    pd = PDServers(tiny_model_path, "tcp", "--disaggregation-decode-enable-offload-kvcache",
                   "--hicache-storage-backend", "file",
                   "--hicache-storage-backend-extra-config", store, prefill_args=prefill_args)
    try:
        info = httpx.get(pd.decode.base_url + "/server_info", timeout=30).json()
        assert info["disaggregation_decode_enable_radix_cache"] is True  # turned on for it
        assert info["disaggregation_decode_retraction_backup"] == "cpu_tensor"
        rng = random.Random(9)
        ids = [rng.randrange(100, 40000) for _ in range(41)]
        out, _ = _turn(pd, server, ids, "turn 1")
        whole = (len(ids) + NEW - 1) // 4 * 4  # the pages the decode server finished with
        deadline = time.monotonic() + 30
        while _load(pd.decode).get("hicache_storage_backup_pages", 0) * 4 < whole:
            assert time.monotonic() < deadline, _load(pd.decode)
            time.sleep(0.2)
        pd.prefill.stop()
        # The decode server learns that the prefill is gone from a request that fails (as
        # in test_pd_disagg.py's restart test); then a fresh prefill on the same ports.
        r = httpx.post(pd.decode.base_url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 2}, **pd.body()},
            timeout=120)
        assert r.status_code == 500, r.text
        pd.prefill = pd.start_prefill(port=pd.prefill.port)
        ids = ids + out + [rng.randrange(100, 40000) for _ in range(5)]
        prefill, decode = pd.generate(ids, max_new_tokens=NEW)
        assert (prefill.status_code, decode.status_code) == (200, 200), decode.text
        assert decode.json()["output_ids"] == _colocated(server, ids)
        read = _load(pd.prefill)["hicache_storage_hit_tokens"]
        assert read >= whole > len(ids[:41]) // 4 * 4, (read, whole)
        assert_no_leak(pd.decode)
        assert_no_leak(pd.prefill)
    finally:
        pd.stop()
