"""The bootstrap fields on the HTTP side of prefill/decode disaggregation: a prefill or decode
server refuses a request without all three (400 naming them), n > 1 and several prompts
(one room is one request), serves a /generate batch with one room per prompt; a co-located
server ignores the fields. The app runs in-process on a fake tokenizer manager that records
what would reach the scheduler, and the scheduler process turns the ipc fields into
EngineRequest.bootstrap."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from kvstrata.entrypoints import pd_fields
from kvstrata.entrypoints.api_server import create_app
from kvstrata.entrypoints.scheduler_process import SchedulerLoop, bootstrap_addr
from kvstrata.frontend import ipc
from kvstrata.metrics import ServerMetrics
from kvstrata.protocol import SamplingParams
from kvstrata.protocol.disagg import FAKE_BOOTSTRAP_HOST, BootstrapAddr

BOOT = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}


class _Tokenizer:
    eos_token_id = 0

    def __len__(self) -> int:
        return 100

    def decode(self, ids, **kwargs) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def apply_chat_template(self, messages, **kwargs):
        return [3, 4, 5]


class _RecordingTM:
    """Answers every request with one token and records the ipc.GenerateReq it was given."""

    def __init__(self):
        self.tokenizer = _Tokenizer()
        self.reqs: list[ipc.GenerateReq] = []
        self.states: dict = {}
        self.load: dict = {}
        self._n = 0

    def new_rid(self) -> str:
        self._n += 1
        return f"r{self._n}"

    def apply_chat_template(self, messages, **kwargs) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        return [1 + ord(c) % 50 for c in text]

    async def generate(self, req: ipc.GenerateReq, log_metrics: bool = True):
        self.reqs.append(req)
        yield ipc.TextOutput(rid=req.rid, text="x", new_token_ids=[7], finished=True,
                             finish_type="length", prompt_tokens=len(req.prompt_ids),
                             completion_tokens=1)


def _client(mode: str) -> tuple[TestClient, _RecordingTM]:
    tm = _RecordingTM()
    args = SimpleNamespace(model_path="m", enable_metrics=True, disaggregation_mode=mode,
                           disaggregation_bootstrap_port=8998, api_key=None)
    state = SimpleNamespace(tm=tm, server_args=args, model_names=["m"], context_len=64,
                            engine_info={}, healthy=lambda: True, metrics=ServerMetrics("m"))
    return TestClient(create_app(state)), tm


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
    assert err["message"].startswith("missing bootstrap_host, bootstrap_port, bootstrap_room: "
                                     f"this server runs in PD mode (--disaggregation-mode "
                                     f"{mode})")
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
    assert (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room) == (
        "10.0.0.1", 8998, 12345)
    # ... through the ipc codec, into EngineRequest.bootstrap
    decoded = ipc.decode(ipc.encode(req), "scheduler")
    assert bootstrap_addr(decoded) == BootstrapAddr("10.0.0.1", 8998, 12345)


@pytest.mark.parametrize("path,body", ROUTES, ids=[r[0] for r in ROUTES])
def test_colocated_server_ignores_the_fields(path, body):
    client, tm = _client("null")
    assert client.post(path, json=body).status_code == 200
    assert client.post(path, json={**body, **BOOT}).status_code == 200
    assert all(r.bootstrap_host is None and r.bootstrap_port is None
               and r.bootstrap_room is None for r in tm.reqs)
    assert all(bootstrap_addr(r) is None for r in tm.reqs)


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
    got = sorted((q.rid[-1], q.bootstrap_host, q.bootstrap_port, q.bootstrap_room)
                 for q in tm.reqs)
    assert got == [("0", "h", 7, 11), ("1", "h", 7, 22)]


@pytest.mark.parametrize("update,param,message", [
    ({"bootstrap_room": 5}, "text", "a batch of 2 prompts: a prefill/decode server needs a "
                                    "list of 2 bootstrap_room values"),
    ({"bootstrap_room": [5, 5]}, "bootstrap_room", "must be distinct"),
    ({"bootstrap_room": [5]}, "bootstrap_room", "has 1 entries for 2 requests"),
    ({"bootstrap_host": ["h"]}, "bootstrap_host", "has 1 entries for 2 requests"),
    ({"bootstrap_port": None}, "bootstrap_port", "missing bootstrap_port"),
])
def test_generate_batch_refusals_in_pd_mode(update, param, message):
    client, tm = _client("decode")
    body = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1},
            **BOOT, "bootstrap_room": [5, 6], **update}
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]
    assert tm.reqs == []


def test_generate_lists_need_a_batch_and_colocated_batch_ignores_them():
    client, _ = _client("null")
    r = client.post("/generate", json={"text": "a", "bootstrap_room": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"
    client, tm = _client("null")
    r = client.post("/generate", json={"text": ["a", "b"], "bootstrap_room": [1, 1],
                                       "bootstrap_host": ["h", "h"],
                                       "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200
    assert [q.bootstrap_room for q in tm.reqs] == [None, None]


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_health_generate_uses_the_warmup_host_in_pd_mode(mode):
    client, tm = _client(mode)
    assert client.get("/health_generate").status_code == 200
    assert client.get("/health_generate").status_code == 200
    a, b = tm.reqs
    assert a.bootstrap_host == FAKE_BOOTSTRAP_HOST and a.bootstrap_port == 8998
    assert a.bootstrap_room != b.bootstrap_room and 0 <= a.bootstrap_room < 1 << 63
    client, tm = _client("null")
    assert client.get("/health_generate").status_code == 200
    assert tm.reqs[0].bootstrap_room is None
    assert pd_fields.warmup_fields(SimpleNamespace()) == {}


def test_scheduler_process_builds_engine_request_bootstrap():
    added = []
    engine = SimpleNamespace(add_request=added.append)
    sent = []
    loop = SchedulerLoop(engine, None, None, SimpleNamespace(send=sent.append))
    sp = SamplingParams(max_new_tokens=1)
    loop.handle(ipc.GenerateReq(rid="a", prompt_ids=[1], sampling_params=sp, **BOOT))
    loop.handle(ipc.GenerateReq(rid="b", prompt_ids=[1], sampling_params=sp))
    assert added[0].bootstrap == BootstrapAddr("10.0.0.1", 8998, 12345)
    assert added[1].bootstrap is None
