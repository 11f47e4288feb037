"""Introspection routes, metrics, and KV accounting after client disconnects."""
from __future__ import annotations

import json
import socket
import time

import httpx


def kv_state(server) -> dict:
    return httpx.get(server.base_url + "/debug/kv", timeout=10).json()


def wait_idle(server, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = kv_state(server)
        if st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0 \
                and st["num_used_tokens"] == 0 or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_introspection_routes(server):
    base = server.base_url
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/health_generate", timeout=60).status_code == 200
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(base + path).json()
        assert info["model_path"].endswith("tiny-llama-smollm2-tok-v1") and "version" in info
    # The scheduler's one start-up resolution and sizing, not the flags as given.
    assert info["device"] == "cpu" and info["chunked_prefill_size"] == 2048
    plan = info["kv_plan"]
    assert plan["max_total_tokens"] == info["max_total_tokens"] == 16384
    assert plan["context_len"] == info["context_length"] == 512
    assert plan["num_rows"] == info["max_running_requests"] == 256
    assert plan["bytes_per_token"] == 2 * 2 * 16 * 2 * 4  # 2 layers x 2 kv heads x 16 x K,V x fp32
    assert {"platform.device", "kv_plan.rows"} <= {r["rule"] for r in info["resolutions"]}
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(base + path).json()
        assert info["is_generation"] is True and info["max_context_len"] == 512
    load = httpx.get(base + "/get_load").json()
    assert {"num_running_reqs", "num_waiting_reqs", "token_usage"} <= set(load)
    assert httpx.post(base + "/flush_cache").status_code == 200


def test_metrics(server, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("kvstrata:prompt_tokens_total", "kvstrata:generation_tokens_total",
                 "kvstrata:time_to_first_token_seconds_bucket",
                 "kvstrata:time_per_output_token_seconds_bucket",
                 "kvstrata:e2e_request_latency_seconds_bucket", "kvstrata:num_running_reqs",
                 "kvstrata:num_queue_reqs", "kvstrata:token_usage", "kvstrata:cache_hit_rate"):
        assert name in text, name


def aborted(server, reason: str) -> float:
    """The value of kvstrata:num_aborted_requests_total for one reason."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvstrata:num_aborted_requests_total" \
                    and sample.labels.get("reason") == reason:
                return sample.value
    raise AssertionError(f"no kvstrata:num_aborted_requests_total{{reason={reason}}}")


def _stream_then_drop(server, path: str, body: dict, chunks: int = 3) -> None:
    with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= chunks:
                    break  # leaving the context closes the connection mid-stream


def test_disconnect_mid_stream_frees_kv(server):
    before = aborted(server, "client_disconnect")
    body = {"model": "tiny", "prompt": "A long story:", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    _stream_then_drop(server, "/v1/completions", body)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Talk."}], "n": 2,
            "max_tokens": 400, "stream": True, "ignore_eos": True}
    _stream_then_drop(server, "/v1/chat/completions", chat)
    st = wait_idle(server)
    assert st["ok"], st
    assert st["num_running_reqs"] == 0 and st["num_used_tokens"] == 0, st
    assert aborted(server, "client_disconnect") == before + 3  # one + a chat with n=2


def _post_then_drop_while_running(server, path: str, body: dict) -> None:
    """POST over a raw socket and close it once the server runs the request: a client
    timeout instead raced the generation (400 tiny-model tokens can finish within 0.5 s)."""
    payload = json.dumps(body).encode()
    host, port = server.base_url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                     .encode() + payload)
        deadline = time.monotonic() + 10
        while kv_state(server)["num_running_reqs"] == 0:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.005)
    finally:
        sock.close()


def test_disconnect_non_streaming_frees_kv_and_logs_one_line(server):
    before = aborted(server, "client_disconnect")
    with open(server.log_path) as f:
        log_start = len(f.read())
    body = {"model": "tiny", "prompt": "Another long story:", "max_tokens": 400,
            "ignore_eos": True}
    _post_then_drop_while_running(server, "/v1/completions", body)
    st = wait_idle(server)
    assert st["ok"] and st["num_running_reqs"] == 0 and st["num_used_tokens"] == 0, st
    assert aborted(server, "client_disconnect") == before + 1
    with open(server.log_path) as f:
        new_log = f.read()[log_start:]
    assert "client disconnected before the response: POST /v1/completions" in new_log
    assert "Traceback" not in new_log and "CancelledError" not in new_log, new_log[-3000:]


def test_disconnect_while_sending_the_body_logs_one_line(server):
    """A client that announces a body and leaves half-way: one INFO line, no traceback."""
    import socket
    with open(server.log_path) as f:
        log_start = len(f.read())
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                         b'{"prompt": "half a bo')
            time.sleep(0.2)
    deadline = time.monotonic() + 10
    while True:
        with open(server.log_path) as f:
            new_log = f.read()[log_start:]
        if new_log.count("client disconnected before the response") >= 3 or \
                time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert new_log.count("client disconnected before the response") == 3, new_log[-3000:]
    assert "Traceback" not in new_log and "ClientDisconnect" not in new_log, new_log[-3000:]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_server_info_internal_states_are_live(server, client):
    """SGLang's internal_states: the scheduler's counters now, not at start-up."""
    client.completions.create(model="tiny", prompt="Live state of a server:", max_tokens=4)
    info = httpx.get(server.base_url + "/server_info", timeout=30).json()
    (state,) = info["internal_states"]
    assert state["live"] is True and state["num_cached_tokens"] > 0, state
    assert {"num_running_reqs", "num_waiting_reqs", "num_retractions", "token_usage",
            "max_total_num_tokens"} <= set(state)
    assert state["kv_plan"] == info["kv_plan"]
    assert state["server_args"]["max_running_requests"] == info["max_running_requests"]
    # The start-up snapshot of those counters is gone from engine_info.
    assert "num_cached_tokens" not in info["engine_info"]
    assert "load" not in info["engine_info"]


def test_abort_request_route(server):
    """Abort by rid while the request streams: it ends early as an abort and frees its KV.
    (Sent after the first chunk, so the request is surely running; a tiny model decodes 400
    tokens in well under a second, so a fixed sleep would race with completion.)"""
    import json

    events = []
    with httpx.stream("POST", server.base_url + "/generate", timeout=60, json={
            "text": "abort me", "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: "):]))
            if len(events) == 1:
                before = aborted(server, "abort_request")
                r = httpx.post(server.base_url + "/abort_request", json={"rid": "to-abort"})
                assert r.status_code == 200
                assert aborted(server, "abort_request") == before + 1
    last = events[-1]
    finish = (last.get("meta_info") or {}).get("finish_reason") or {}
    assert last.get("error") or finish.get("type") == "abort", last
    completion = (last.get("meta_info") or {}).get("completion_tokens", 0)
    assert completion < 400, last
    st = wait_idle(server)
    assert st["ok"] and st["num_running_reqs"] == 0 and st["num_used_tokens"] == 0, st

def test_generate_batch_equals_single_calls(server):
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    texts = ["The first prompt", "A second, longer prompt than the first one"]
    batch = httpx.post(server.base_url + "/generate", timeout=60,
                       json={"text": texts, "sampling_params": params}).json()
    assert isinstance(batch, list) and len(batch) == 2
    for text, item in zip(texts, batch):
        one = httpx.post(server.base_url + "/generate", timeout=60,
                         json={"text": text, "sampling_params": params}).json()
        assert item["output_ids"] == one["output_ids"] and len(item["output_ids"]) == 6
    ids = httpx.post(server.base_url + "/generate", timeout=60, json={
        "input_ids": [[5, 6, 7], [8, 9]], "rid": ["b-0", "b-1"],
        "sampling_params": [params, {**params, "max_new_tokens": 2}]}).json()
    assert [r["meta_info"]["id"] for r in ids] == ["b-0", "b-1"]
    assert [len(r["output_ids"]) for r in ids] == [6, 2]


def test_get_load_is_current_after_a_request_and_after_a_flush(server):
    """/get_load answers from the load the scheduler publishes; it is sent ahead of a step's
    outputs and of control replies, so it is never older than what the client saw."""
    base = server.base_url
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "remember this prompt " * 8, "max_tokens": 2})
    assert r.status_code == 200
    load = httpx.get(base + "/get_load").json()
    assert load["num_cached_tokens"] > 0 and load["num_running_reqs"] == 0, load
    assert httpx.post(base + "/flush_cache").status_code == 200
    assert httpx.get(base + "/get_load").json()["num_cached_tokens"] == 0
