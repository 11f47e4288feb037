"""sglang-router 0.3.2 in PD mode (--pd-disaggregation) in front of two kvstrata API
servers, one --disaggregation-mode prefill and one decode. The API servers run in-process
on a fake tokenizer manager (no model, no scheduler: tests/helpers/fake_frontend.py), so this
checks the HTTP contract only, in seconds: the router registers both workers from
/health, /server_info and /model_info, and sends every route to both with the same
bootstrap_host/port/room, which kvstrata carries into the request that would reach the
scheduler. (The real two-server transfer is tested with the engine.)"""
from __future__ import annotations

import importlib.util

import httpx
import pytest

from kvstrata.config import ServerArgs
from kvstrata.entrypoints.api.api_server import create_app
from tests.e2e.test_sglang_router import Router
from tests.helpers.fake_frontend import app_state, serve_app

BOOTSTRAP_PORT = 9123  # only named, nobody listens: the fake servers move no KV


def _serve(mode: str):
    args = ServerArgs(model_path="m", disaggregation_mode=mode,
                      disaggregation_bootstrap_port=BOOTSTRAP_PORT)
    state = app_state(args, context_len=4096)
    server, thread, port = serve_app(create_app(state))
    return server, thread, f"http://127.0.0.1:{port}", state.tm


@pytest.fixture(scope="module")
def pd():
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (pip install -e '.[dev]')")
    servers = [_serve("prefill"), _serve("decode")]
    (_, _, prefill_url, prefill_tm), (_, _, decode_url, decode_tm) = servers
    router = None
    try:
        router = Router([], mode_args=["--pd-disaggregation", "--prefill", prefill_url,
                                       str(BOOTSTRAP_PORT), "--decode", decode_url],
                        workers=2)
        yield router, prefill_url, decode_url, prefill_tm, decode_tm
    finally:
        if router is not None:
            router.stop()
        for server, thread, *_ in servers:
            server.should_exit = True
            thread.join(10)


def _bootstraps(tm, start: int) -> list[tuple]:
    return [(r.bootstrap.host, r.bootstrap.port, r.bootstrap.room) if r.bootstrap else
            (None, None, None) for r in tm.reqs[start:]]


def test_router_registers_kvstrata_prefill_and_decode(pd):
    router, prefill_url, decode_url, *_ = pd
    workers = httpx.get(router.base_url + "/workers", timeout=10).json()["workers"]
    by_type = {w["worker_type"]: w for w in workers}
    assert by_type["prefill"]["url"] == prefill_url and by_type["decode"]["url"] == decode_url
    assert by_type["prefill"]["bootstrap_port"] == BOOTSTRAP_PORT
    # what it read from /server_info
    assert by_type["prefill"]["metadata"]["disaggregation_mode"] == "prefill"
    assert by_type["decode"]["metadata"]["disaggregation_mode"] == "decode"


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path,body,engine_requests", [
    ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}}, 1),
    ("/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 2}, 1),
    ("/v1/chat/completions", CHAT, 1),
    ("/v1/chat/completions", {**CHAT, "n": 2}, 2),  # the router sends lists of 2
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "max_tokens": 2}, 2),
    ("/generate", {"input_ids": [[1, 2], [3, 4]], "sampling_params": {"max_new_tokens": 2}}, 2),
])
def test_both_servers_get_the_same_bootstrap_fields(pd, path, body, engine_requests):
    router, _, _, prefill_tm, decode_tm = pd
    p0, d0 = len(prefill_tm.reqs), len(decode_tm.reqs)
    r = httpx.post(router.base_url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    on_prefill, on_decode = _bootstraps(prefill_tm, p0), _bootstraps(decode_tm, d0)
    assert len(on_prefill) == engine_requests and sorted(on_prefill) == sorted(on_decode)
    rooms = {room for _, _, room in on_prefill}
    assert len(rooms) == engine_requests and all(isinstance(x, int) for x in rooms)
    assert {(h, p) for h, p, _ in on_prefill} == {("127.0.0.1", BOOTSTRAP_PORT)}


def test_one_room_for_several_choices_is_a_clean_400(pd):
    # the router sends a single room for completions n=2: kvstrata names the problem
    router, *_ = pd
    r = httpx.post(router.base_url + "/v1/completions",
                   json={"model": "m", "prompt": "hello", "max_tokens": 2, "n": 2}, timeout=30)
    assert r.status_code == 400
    assert "needs a list of 2 bootstrap_room values" in r.text


def test_a_request_that_bypasses_the_router_is_refused(pd):
    _, _, decode_url, _, decode_tm = pd
    before = len(decode_tm.reqs)
    r = httpx.post(decode_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                   timeout=10)
    assert r.status_code == 400
    assert "missing bootstrap_host, bootstrap_room" in r.json()["error"]["message"]
    assert len(decode_tm.reqs) == before


def test_router_without_a_bootstrap_port_uses_the_servers_own(pd):
    """`--prefill URL` without a port: the router sends bootstrap_port null, and each server
    uses its own --disaggregation-bootstrap-port (SGLang's fallback)."""
    _, prefill_url, decode_url, prefill_tm, decode_tm = pd
    router = Router([], mode_args=["--pd-disaggregation", "--prefill", prefill_url,
                                   "--decode", decode_url], workers=2)
    try:
        p0, d0 = len(prefill_tm.reqs), len(decode_tm.reqs)
        r = httpx.post(router.base_url + "/v1/completions",
                       json={"model": "m", "prompt": "hello", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        assert _bootstraps(prefill_tm, p0) == _bootstraps(decode_tm, d0)
        assert _bootstraps(decode_tm, d0)[0][:2] == ("127.0.0.1", BOOTSTRAP_PORT)
    finally:
        router.stop()
