"""Every bad-input case gets its 4xx and an OpenAI error body naming the field; none of
them takes the server down or leaks KV pages."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.test_routes_and_disconnect import wait_idle

MSG = [{"role": "user", "content": "hi"}]
CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
LONG_PROMPT = "hello " * 700  # > 512-token context of the test server

CASES = [
    # (id, path, body (dict, or raw str), status, param)
    ("malformed_json", CHAT, '{"model": "tiny", "messages": [', 400, None),
    ("not_an_object", CHAT, "[1, 2]", 400, None),
    ("wrong_type_max_tokens", CHAT, {"messages": MSG, "max_tokens": "ten"}, 400, "max_tokens"),
    ("wrong_type_stream", COMP, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("wrong_type_messages", CHAT, {"messages": "hi"}, 400, "messages"),
    ("bad_role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("unknown_model", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "model"),
    ("negative_max_tokens", COMP, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("zero_max_tokens_chat", CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("huge_max_tokens", CHAT, {"messages": MSG, "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("huge_max_completion_tokens", CHAT, {"messages": MSG, "max_completion_tokens": 10 ** 6},
     400, "max_completion_tokens"),
    ("temperature_high", CHAT, {"messages": MSG, "temperature": 1000}, 400, "temperature"),
    ("temperature_negative", COMP, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("top_p_zero", CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("top_p_high", COMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_k_zero", COMP, {"prompt": "x", "top_k": 0}, 400, "top_k"),
    ("n_zero", CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    ("empty_messages", CHAT, {"messages": []}, 400, "messages"),
    ("empty_prompt", COMP, {"prompt": ""}, 400, "prompt"),
    ("prompt_too_long", COMP, {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt"),
    ("messages_too_long", CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400,
     "messages"),
    ("token_id_out_of_vocab", COMP, {"prompt": [1, 10 ** 7]}, 400, "prompt"),
    ("unknown_field", CHAT, {"messages": MSG, "temprature": 0.5}, 400, "temprature"),
    ("unknown_nested_field", CHAT, {"messages": MSG, "stream_options": {"foo": 1}}, 400,
     "stream_options.foo"),
    ("unimplemented_tools", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("unimplemented_logit_bias", COMP, {"prompt": "x", "logit_bias": {"1": 5}}, 400,
     "logit_bias"),
    ("top_logprobs_without_logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("logprobs_too_many", COMP, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("stop_empty_string", COMP, {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("generate_text_and_ids", GEN, {"text": "x", "input_ids": [1]}, 400, "text"),
    ("generate_unknown_sampling_param", GEN,
     {"text": "x", "sampling_params": {"regex": "a+"}}, 400, "sampling_params.regex"),
    ("generate_bad_sampling_value", GEN,
     {"text": "x", "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    ("generate_too_long", GEN, {"input_ids": [1] * 600}, 400, "input_ids"),
    ("generate_batch_stream", GEN, {"text": ["a", "b"], "stream": True}, 400, "stream"),
    ("generate_batch_params_mismatch", GEN,
     {"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
    ("generate_batch_empty", GEN, {"text": []}, 400, "text"),
    ("generate_params_list_single_prompt", GEN,
     {"text": "a", "sampling_params": [{}]}, 400, "sampling_params"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, case):
    _, path, body, status, param = case
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.base_url + path, content=content,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["param"] == param, err


def test_body_over_size_limit(server):
    big = {"model": "tiny", "prompt": "x" * (2 << 20)}  # server limit: 1 MiB
    r = httpx.post(server.base_url + COMP, json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["message"]


def test_openai_client_sees_error_body(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, temperature=7000)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)


def test_streaming_bad_input_is_http_error(server):
    body = {"model": "tiny", "prompt": LONG_PROMPT, "stream": True}
    r = httpx.post(server.base_url + COMP, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_server_survives_bad_input_without_leaks(server, client):
    assert httpx.get(server.base_url + "/health").status_code == 200
    r = client.completions.create(model="tiny", prompt="still alive", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    st = wait_idle(server)
    assert st["ok"] and st["num_used_tokens"] == 0, st
