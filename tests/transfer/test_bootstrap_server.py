"""The bootstrap server's routes (SGLang's CommonKVBootstrapServer protocol, reference
section 3.2), spoken to over real HTTP with httpx."""
from __future__ import annotations

import time

import httpx
import pytest

from kvstrata.transfer.disagg.bootstrap_client import (RouteNotReady, fetch_prefill_info,
                                                       fetch_prefill_rank, register_rank)
from kvstrata.transfer.disagg.bootstrap_server import BootstrapServer
from tests.helpers.ports import free_port

ALL = dict(prefill_dp_rank=-1, prefill_cp_rank=-1, target_tp_rank=-1, target_pp_rank=-1)
RANK0 = dict(prefill_dp_rank=0, prefill_cp_rank=0, target_tp_rank=0, target_pp_rank=0)


def rank_info(tp_rank: int = 0, tp_size: int = 1, port: int = 5000) -> dict:
    return dict(rank_ip="127.0.0.1", rank_port=port + tp_rank, page_size=16,
                kv_cache_dtype="bfloat16", attn_tp_size=tp_size, attn_tp_rank=tp_rank,
                attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0, pp_size=1,
                pp_rank=0, system_dp_size=1, system_dp_rank=0)


@pytest.fixture
def server():
    port = free_port()
    srv = BootstrapServer("127.0.0.1", port, cleanup_interval=0.2)
    srv.start()
    yield srv, f"http://127.0.0.1:{port}"
    srv.stop()


def test_routes(server):
    srv, url = server
    assert httpx.get(f"{url}/health").text == "OK"
    # every one of the four parameters is required
    for missing in ALL:
        params = {k: v for k, v in ALL.items() if k != missing}
        assert httpx.get(f"{url}/route", params=params).status_code == 400
    assert httpx.get(f"{url}/route", params={**ALL, "target_tp_rank": "x"}).status_code == 400
    # nothing registered: the parallel info is not ready
    r = httpx.get(f"{url}/route", params=ALL)
    assert (r.status_code, r.text) == (
        503, "Prefill server not fully registered yet (0 workers registered).")
    with pytest.raises(RouteNotReady):
        fetch_prefill_info("127.0.0.1", srv.port)
    # a two-rank (tp=2) prefill: ready only once both registered
    register_rank("127.0.0.1", srv.port, rank_info(0, 2))
    r = httpx.get(f"{url}/route", params=ALL)
    assert (r.status_code, r.text) == (
        503, "Prefill server not fully registered yet (1 workers registered).")
    assert httpx.get(f"{url}/route", params=RANK0).json() == {"rank_ip": "127.0.0.1",
                                                             "rank_port": 5000}
    assert httpx.put(f"{url}/route", json=rank_info(1, 2)).status_code == 200
    info = httpx.get(f"{url}/route", params=ALL).json()
    assert (info["attn_tp_size"], info["dp_size"], info["attn_cp_size"], info["pp_size"],
            info["page_size"], info["kv_cache_dtype"]) == (2, 1, 1, 1, 16, "bfloat16")
    assert httpx.get(f"{url}/route", params={**RANK0, "target_tp_rank": 1}).json()[
        "rank_port"] == 5001
    assert httpx.get(f"{url}/route", params={**RANK0, "target_pp_rank": 3}).status_code == 404
    assert fetch_prefill_info("127.0.0.1", srv.port)["attn_tp_size"] == 2
    # SGLang's earlier form: engine_rank (the tp rank) and target_dp_group
    legacy = httpx.get(f"{url}/route", params={"engine_rank": -1, "target_dp_group": -1}).json()
    assert (legacy["prefill_tp_size"], legacy["prefill_dp_size"], legacy["prefill_pp_size"],
            legacy["page_size"]) == (2, 1, 1, 16)
    assert httpx.get(f"{url}/route", params={"engine_rank": 1, "target_dp_group": 0}).json()[
        "rank_port"] == 5001
    assert httpx.get(f"{url}/route", params={"engine_rank": 1, "target_dp_group": 0,
                                             "target_pp_rank": 0}).json()["rank_port"] == 5001
    r = httpx.get(f"{url}/route", params={"engine_rank": 0})
    assert (r.status_code, r.text) == (400, "Missing inputs for bootstrap server.")
    assert fetch_prefill_rank("127.0.0.1", srv.port, 1) == "tcp://127.0.0.1:5001"
    assert httpx.put(f"{url}/route", json={"page_size": 1}).status_code == 400


def test_room_entries_are_cleaned_up():
    """Room entries older than the cleanup interval go, by the server's own task. Timing-
    safe on a loaded box: the entry is checked as present only while it is younger than the
    interval (the task may remove it any time after), and "fresh" is judged at the
    registration time passed in."""
    interval = 1.0
    port = free_port()
    srv = BootstrapServer("127.0.0.1", port, cleanup_interval=interval)
    srv.start()
    url = f"http://127.0.0.1:{port}"
    try:
        registered = time.monotonic()
        httpx.post(f"{url}/register_dp_rank", json={"bootstrap_room": 11, "dp_rank": 0})
        got = httpx.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": [11, 12]}).json()
        if time.monotonic() - registered < interval:
            assert got == {"11": 0}
        assert srv.cleanup_rooms(now=registered) == 0  # fresh at registration time
        deadline = time.monotonic() + 10
        while srv.room_to_dp_rank and time.monotonic() < deadline:  # the server's own task
            time.sleep(0.05)
        assert httpx.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": [11]}).json() == {}
    finally:
        srv.stop()


def test_stop_frees_the_port():
    port = free_port()
    for _ in range(2):  # a second server on the same port: the first really stopped
        srv = BootstrapServer("127.0.0.1", port)
        srv.start()
        assert httpx.get(f"http://127.0.0.1:{port}/health").text == "OK"
        srv.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
