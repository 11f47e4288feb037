"""The bootstrap fields on the HTTP side of prefill/decode disaggregation: a prefill or decode
server refuses a request without all three (400 naming them), n > 1 and several prompts
(one room is one request), serves a /generate batch with one room per prompt; a co-located
server ignores the fields. The app runs in-process on a fake tokenizer manager
(tests/helpers/fake_frontend.py) that records what would reach the scheduler, and the scheduler process turns the ipc fields into
EngineRequest.bootstrap."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from kvstrata.entrypoints.api import pd_fields
from kvstrata.entrypoints.api.api_server import create_app
from kvstrata.entrypoints.scheduler_process import SchedulerLoop
from kvstrata.frontend import ipc
from kvstrata.protocol import SamplingParams
from kvstrata.protocol.disagg import FAKE_BOOTSTRAP_HOST, BootstrapAddr
from tests.helpers.fake_frontend import RecordingTM, app_state

BOOT = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}


def _client(mode: str) -> tuple[TestClient, RecordingTM]:
    args = SimpleNamespace(model_path="m", enable_metrics=True, disaggregation_mode=mode,
                           disaggregation_bootstrap_port=8998, api_key=None)
    state = app_state(args)
    return TestClient(create_app(state)), state.tm


CHAT = {"messages": [{"role": "user", "content": "hi"}], "input_ids": [3, 4, 5],
        "max_tokens": 1}
ROUTES = [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hello", "max_tokens": 1}),
          ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 1}})]


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("path,body", ROUTES, ids=[r[0] for r in ROUTES])
def test_pd_server_without_bootstrap_fields_is_400(mode, path, body):
    client, tm = _client(mode)
    r = client.post(path, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"].startswith("missing bootstrap_host, bootstrap_room: this server "
                                     f"runs in PD mode (--disaggregation-mode {mode})")
    assert "PD router" in err["message"] and err["param"] == "bootstrap_host"
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    # only the room missing: only the room named
    r = client.post(path, json={**body, "bootstrap_host": "h", "bootstrap_port": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"
    assert r.json()["error"]["message"].startswith("missing bootstrap_room:")
    assert tm.reqs == []


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("path,body", ROUTES, ids=[r[0] for r in ROUTES])
def test_pd_server_carries_the_fields_to_the_scheduler(mode, path, body):
    client, tm = _client(mode)
    r = client.post(path, json={**body, **BOOT})
    assert r.status_code == 200, r.text
    (req,) = tm.reqs
    assert req.bootstrap == BootstrapAddr("10.0.0.1", 8998, 12345)
    # ... whole through the ipc codec: the scheduler gets the engine's own request
    decoded = ipc.decode(ipc.encode(req), "scheduler")
    assert decoded == req and decoded.bootstrap == BootstrapAddr("10.0.0.1", 8998, 12345)


@pytest.mark.parametrize("path,body", ROUTES, ids=[r[0] for r in ROUTES])
def test_missing_port_is_the_servers_own_bootstrap_port(path, body):
    """SGLang: a request without bootstrap_port (sglang-router sends null when its --prefill
    URL has no port) uses the server's --disaggregation-bootstrap-port."""
    client, tm = _client("decode")
    r = client.post(path, json={**body, **BOOT, "bootstrap_port": None})
    assert r.status_code == 200, r.text
    assert tm.reqs[0].bootstrap == BootstrapAddr("10.0.0.1", 8998, 12345)


@pytest.mark.parametrize("path,body", ROUTES, ids=[r[0] for r in ROUTES])
def test_colocated_server_ignores_the_fields(path, body):
    client, tm = _client("null")
    assert client.post(path, json=body).status_code == 200
    assert client.post(path, json={**body, **BOOT}).status_code == 200
    assert all(r.bootstrap is None for r in tm.reqs)


SEVERAL = [
    ("/v1/chat/completions", {**CHAT, "n": 2}, "n"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 1, "n": 2}, "n"),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1}, "prompt"),
]


@pytest.mark.parametrize("path,body,param", SEVERAL)
def test_pd_server_refuses_one_room_for_several_choices(path, body, param):
    client, tm = _client("decode")
    r = client.post(path, json={**body, **BOOT})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert "needs a list of 2 bootstrap_room values" in r.json()["error"]["message"]
    r = client.post(path, json={**body, **BOOT, "bootstrap_room": [1, 1]})
    assert r.status_code == 400 and "must be distinct" in r.json()["error"]["message"]
    r = client.post(path, json={**body, **BOOT, "bootstrap_room": [1, 2, 3]})
    assert r.status_code == 400 and "has 3 entries for 2 requests" in r.json()["error"]["message"]
    assert tm.reqs == []
    # the same request is fine on a co-located server
    client, _ = _client("null")
    assert client.post(path, json={**body, **BOOT}).status_code == 200


@pytest.mark.parametrize("path,body,param", SEVERAL)
def test_pd_server_serves_one_room_per_choice(path, body, param):
    """sglang-router 0.3.2 sends lists of n for chat n > 1: choice j gets room j."""
    client, tm = _client("prefill")
    r = client.post(path, json={**body, "bootstrap_host": ["h", "h"], "bootstrap_port": [7, 7],
                                "bootstrap_room": [11, 22]})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    got = sorted((q.rid[-1], q.bootstrap.host, q.bootstrap.port, q.bootstrap.room)
                 for q in tm.reqs)
    assert got == [("0", "h", 7, 11), ("1", "h", 7, 22)]


@pytest.mark.parametrize("update,param,message", [
    ({"bootstrap_room": 5}, "text", "a batch of 2 prompts: a prefill/decode server needs a "
                                    "list of 2 bootstrap_room values"),
    ({"bootstrap_room": [5, 5]}, "bootstrap_room", "must be distinct"),
    ({"bootstrap_room": [5]}, "bootstrap_room", "has 1 entries for 2 requests"),
    ({"bootstrap_host": ["h"]}, "bootstrap_host", "has 1 entries for 2 requests"),
    ({"bootstrap_host": None}, "bootstrap_host", "missing bootstrap_host"),
])
def test_generate_batch_refusals_in_pd_mode(update, param, message):
    client, tm = _client("decode")
    body = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1},
            **BOOT, "bootstrap_room": [5, 6], **update}
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]
    assert tm.reqs == []


def test_generate_batch_of_input_ids_names_input_ids():
    client, _ = _client("decode")
    r = client.post("/generate", json={"input_ids": [[1], [2]], **BOOT,
                                       "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"


def test_generate_lists_need_a_batch_and_colocated_batch_ignores_them():
    client, _ = _client("null")
    r = client.post("/generate", json={"text": "a", "bootstrap_room": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"
    client, tm = _client("null")
    r = client.post("/generate", json={"text": ["a", "b"], "bootstrap_room": [1, 1],
                                       "bootstrap_host": ["h", "h"],
                                       "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200
    assert [q.bootstrap for q in tm.reqs] == [None, None]


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_health_generate_uses_the_warmup_host_in_pd_mode(mode):
    client, tm = _client(mode)
    assert client.get("/health_generate").status_code == 200
    assert client.get("/health_generate").status_code == 200
    a, b = tm.reqs
    assert a.bootstrap.host == FAKE_BOOTSTRAP_HOST and a.bootstrap.port == 8998
    assert a.bootstrap.room != b.bootstrap.room and 0 <= a.bootstrap.room < 1 << 63
    client, tm = _client("null")
    assert client.get("/health_generate").status_code == 200
    assert tm.reqs[0].bootstrap is None
    assert pd_fields.warmup_bootstrap(SimpleNamespace()) is None


def test_scheduler_process_builds_engine_request_bootstrap():
    added = []
    engine = SimpleNamespace(add_request=added.append)
    sent = []
    loop = SchedulerLoop(engine, None, None, SimpleNamespace(send=sent.append))
    sp = SamplingParams(max_new_tokens=1)
    loop.handle(ipc.GenerateReq(rid="a", prompt_ids=[1], sampling_params=sp,
                                bootstrap=BootstrapAddr("10.0.0.1", 8998, 12345)))
    loop.handle(ipc.GenerateReq(rid="b", prompt_ids=[1], sampling_params=sp))
    assert added[0].bootstrap == BootstrapAddr("10.0.0.1", 8998, 12345)
    assert added[1].bootstrap is None


def test_server_info_and_model_info_show_the_pd_role():
    """What sglang-router 0.3.2 reads at PD registration (GET /health, /server_info,
    /model_info): it copies disaggregation_mode, tp_size and model_path into the worker's
    metadata; the bootstrap port comes from its own --prefill URL PORT argument."""
    from kvstrata.config import ServerArgs
    args = ServerArgs(model_path="m", disaggregation_mode="prefill",
                      disaggregation_bootstrap_port=9100)
    client = TestClient(create_app(app_state(args)))
    info = client.get("/server_info").json()
    assert (info["disaggregation_mode"], info["disaggregation_bootstrap_port"],
            info["disaggregation_transfer_backend"], info["tp_size"], info["model_path"]) == (
        "prefill", 9100, "tcp", 1, "m")
    assert client.get("/get_server_info").json()["disaggregation_mode"] == "prefill"
    assert client.get("/model_info").json()["model_path"] == "m"
    assert client.get("/health").status_code == 200


def test_server_info_internal_states_are_asked_live():
    """/server_info carries SGLang's internal_states from the scheduler at call time (not a
    start-up snapshot): each call is a new round trip."""
    from kvstrata.config import ServerArgs
    client = TestClient(create_app(app_state(ServerArgs(model_path="m"))))
    first = client.get("/server_info").json()["internal_states"]
    second = client.get("/get_server_info").json()["internal_states"]
    assert len(first) == 1 and first[0]["live"] is True
    assert second[0]["control_calls"] == first[0]["control_calls"] + 1
    assert first[0]["server_args"]["model_path"] == "m" and "num_retractions" in first[0]


@pytest.mark.parametrize("path,body", ROUTES, ids=[r[0] for r in ROUTES])
def test_priority_field_reaches_the_engine_request(path, body):
    """SGLang's `priority` (what sglang-router forwards) is carried to the scheduler on every
    route; absent, it stays None (the engine applies --default-priority-value); not an int,
    a 400 naming it."""
    client, tm = _client("null")
    assert client.post(path, json={**body, "priority": 7}).status_code == 200
    assert client.post(path, json=body).status_code == 200
    assert [r.priority for r in tm.reqs] == [7, None]
    decoded = ipc.decode(ipc.encode(tm.reqs[0]), "scheduler")
    assert decoded.priority == 7
    r = client.post(path, json={**body, "priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
