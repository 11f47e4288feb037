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
    # an int past int64 cannot cross to the scheduler (msgpack): a 400, not a 500 (fuzz)
    ("priority_past_int64", COMP, {"prompt": "x", "priority": -(1 << 90)}, 400, "priority"),
    ("priority_past_int64_native", GEN, {"text": "x", "priority": 1 << 63}, 400, "priority"),
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
    ("tool_without_function", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400,
     "tools.0.function"),
    ("unimplemented_functions", CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, 400,
     "functions"),
    ("logit_bias_out_of_vocab", COMP, {"prompt": "x", "logit_bias": {"10000000": 5}}, 400,
     "logit_bias"),
    ("logit_bias_key_not_an_id", CHAT, {"messages": MSG, "logit_bias": {"the": 5}}, 400,
     "logit_bias"),
    ("logit_bias_negative_id", COMP, {"prompt": "x", "logit_bias": {"-1": 5}}, 400,
     "logit_bias"),
    ("logit_bias_value_not_a_number", CHAT, {"messages": MSG, "logit_bias": {"1": "5"}}, 400,
     "logit_bias"),
    ("logit_bias_nan", COMP, '{"prompt": "x", "logit_bias": {"1": NaN}}', 400, None),
    # OpenAI's range for the values (issue 59): was a 200 that always drew token 1
    ("logit_bias_past_openai_range", COMP, {"prompt": "x", "logit_bias": {"1": 1e308}}, 400,
     "logit_bias"),
    ("logit_bias_below_openai_range", CHAT, {"messages": MSG, "logit_bias": {"1": -100.5}},
     400, "logit_bias"),
    ("generate_logit_bias_out_of_vocab", GEN,
     {"text": "x", "sampling_params": {"logit_bias": {"10000000": 1}}}, 400,
     "sampling_params.logit_bias"),
    ("generate_logit_bias_key_not_an_id", GEN,
     {"text": "x", "sampling_params": {"logit_bias": {"1.5": 1}}}, 400,
     "sampling_params.logit_bias"),
    ("top_logprobs_without_logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("logprobs_too_many", COMP, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("stop_empty_string", COMP, {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("generate_text_and_ids", GEN, {"text": "x", "input_ids": [1]}, 400, "text"),
    ("generate_bad_regex", GEN,
     {"text": "x", "sampling_params": {"regex": "a(b"}}, 400, "sampling_params.regex"),
    ("generate_two_grammars", GEN,
     {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, 400,
     "sampling_params.regex"),
    ("generate_structural_tag", GEN,
     {"text": "x", "sampling_params": {"structural_tag": "{}"}}, 400,
     "sampling_params.structural_tag"),
    ("generate_json_schema_not_a_string", GEN,
     {"text": "x", "sampling_params": {"json_schema": {"type": "object"}}}, 400,
     "sampling_params.json_schema"),
    ("chat_bad_json_schema", CHAT,
     {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    ("chat_json_schema_missing", CHAT,
     {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x"}}}, 400, "response_format"),
    ("chat_response_format_unknown_type", CHAT,
     {"messages": MSG, "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("chat_structural_tag", CHAT,
     {"messages": MSG, "response_format": {"type": "structural_tag"}}, 400,
     "response_format"),
    ("chat_response_format_and_regex", CHAT,
     {"messages": MSG, "response_format": {"type": "json_object"}, "regex": "a"}, 400,
     "response_format"),
    ("completion_bad_ebnf", COMP, {"prompt": "x", "ebnf": 'root ::= "a'}, 400, "ebnf"),
    # Past the grammar limits (issue 59): refused before llguidance compiles anything
    ("chat_json_schema_too_many_optional", CHAT,
     {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "object", "properties": {
             f"p{i}": {"type": "string"} for i in range(1200)}}}}}, 400, "response_format"),
    ("chat_structural_tag_too_many_optional", CHAT,
     {"messages": MSG, "response_format": {"type": "structural_tag", "triggers": ["<f"],
                                           "structures": [{"begin": "<f>", "end": "</f>",
                                                           "schema": {"properties": {
         f"p{i}": {"type": "string"} for i in range(1200)}}}]}}, 400, "response_format"),
    ("completion_regex_nested_repetitions", COMP,
     {"prompt": "x", "regex": "((a{1,100}){1,100}){1,100}"}, 400, "regex"),
    ("generate_regex_nested_repetitions", GEN,
     {"text": "x", "sampling_params": {"regex": "(a{1000}){1000}"}}, 400,
     "sampling_params.regex"),
    ("completion_vllm_regex_nested_repetitions", COMP,
     {"prompt": "x", "structured_outputs": {"regex": "(a{1000}){1000}"}}, 400,
     "structured_outputs"),
    ("completion_bad_json_schema_string", COMP, {"prompt": "x", "json_schema": "{"}, 400,
     "json_schema"),
    ("completion_json_schema_and_response_format", COMP,
     {"prompt": "x", "json_schema": "{}", "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("generate_bad_sampling_value", GEN,
     {"text": "x", "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    ("generate_too_long", GEN, {"input_ids": [1] * 600}, 400, "input_ids"),
    # Wrongly typed list fields of the native sampling_params (were a 500 TypeError, or
    # silently accepted: a dict's keys as stop strings, 0 as "no stop").
    *[(f"generate_{name}_{kind}", GEN,
       {"text": "hi", "sampling_params": {"max_new_tokens": 4, name: value}}, 400,
       f"sampling_params.{name}{item}")
      for name, kind, value, item in [("stop", "int", 5, ""), ("stop", "bool", True, ""),
                                      ("stop", "zero", 0, ""), ("stop", "dict", {"a": 1}, ""),
                                      ("stop", "list_of_int", [1], ".0"),
                                      ("stop_token_ids", "int", 5, ""),
                                      ("stop_token_ids", "str", "5", ""),
                                      ("stop_token_ids", "dict", {"1": 2}, ""),
                                      ("stop_token_ids", "bool_item", [True], ".0")]],
    ("generate_batch_stream", GEN, {"text": ["a", "b"], "stream": True}, 400, "stream"),
    ("generate_batch_params_mismatch", GEN,
     {"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
    ("generate_batch_empty", GEN, {"text": []}, 400, "text"),
    ("generate_params_list_single_prompt", GEN,
     {"text": "a", "sampling_params": [{}]}, 400, "sampling_params"),
    ("generate_unknown_model", GEN, {"text": "x", "model": "gpt-9"}, 404, "model"),
    ("generate_unknown_to_sglang_too", GEN, {"text": "x", "colour": 1}, 400, "colour"),
    ("generate_sampling_key_unknown_to_sglang", GEN,
     {"text": "x", "sampling_params": {"colour": 1}}, 400, "sampling_params"),
    # SGLang fields accepted only at their default.
    ("sglang_field_not_default", CHAT, {"messages": MSG, "return_hidden_states": True}, 400,
     "return_hidden_states"),
    ("sglang_completion_field_not_default", COMP, {"prompt": "x", "lora_path": "a"}, 400,
     "lora_path"),
    ("stop_regex_invalid", COMP, {"prompt": "x", "stop_regex": "a("}, 400, "stop_regex"),
    ("generate_stop_regex_invalid", GEN,
     {"text": "x", "sampling_params": {"stop_regex": ["ok", "(?P<"]}}, 400,
     "sampling_params.stop_regex"),
    ("generate_sglang_field_not_default", GEN, {"text": "x", "background": True}, 400,
     "background"),
    ("generate_sampling_n_zero", GEN, {"text": "x", "sampling_params": {"n": 0}}, 400,
     "sampling_params.n"),
    ("generate_sampling_n_too_many", GEN, {"text": "x", "sampling_params": {"n": 65}}, 400,
     "sampling_params.n"),
    ("generate_sampling_n_differs", GEN,
     {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, 400, "sampling_params.n"),
    ("generate_sampling_n_stream", GEN,
     {"text": "x", "stream": True, "sampling_params": {"n": 2}}, 400, "stream"),
    ("generate_sampling_n_rid_list", GEN,
     {"text": ["a", "b"], "rid": ["r0", "r1"], "sampling_params": {"n": 2}}, 400, "rid"),
    ("rid_list", CHAT, {"messages": MSG, "rid": ["a"]}, 400, "rid"),
    ("chat_template_kwargs_reserved", CHAT,
     {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs.tokenize"),
    ("chat_input_ids_out_of_vocab", CHAT, {"messages": MSG, "input_ids": [10 ** 7]}, 400,
     "input_ids"),
    # Integers wider than 64 bits (used to be OverflowError 500s).
    ("seed_too_wide", CHAT, {"messages": MSG, "seed": 2 ** 70}, 400, "seed"),
    ("stop_token_ids_too_wide", COMP, {"prompt": "x", "stop_token_ids": [2 ** 70]}, 400,
     "stop_token_ids"),
    ("bootstrap_room_too_wide", CHAT, {"messages": MSG, "bootstrap_room": 2 ** 70}, 400,
     "bootstrap_room"),
    ("generate_input_ids_too_wide", GEN, {"input_ids": [2 ** 70]}, 400, "input_ids"),
    ("generate_input_ids_out_of_vocab", GEN, {"input_ids": [1, 10 ** 7]}, 400, "input_ids"),
    ("generate_seed_too_wide", GEN, {"text": "x", "sampling_params": {"seed": 2 ** 70}}, 400,
     "sampling_params.seed"),
    ("generate_top_k_too_wide", GEN, {"text": "x", "sampling_params": {"top_k": 2 ** 70}},
     400, "sampling_params.top_k"),
    ("deeply_nested_json", CHAT,
     '{"messages": [], "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None),
    ("generate_batch_duplicate_rids", GEN, {"text": ["a", "b"], "rid": ["r", "r"]}, 400,
     "rid"),
    # The field the client sent, by its name.
    ("top_logprobs_num_too_many", GEN,
     {"text": "x", "return_logprob": True, "top_logprobs_num": 50}, 400, "top_logprobs_num"),
    ("message_without_content", CHAT, {"messages": [{"role": "user"}]}, 400,
     "messages.0.content"),
    ("message_with_no_parts", CHAT, {"messages": [{"role": "user", "content": []}]}, 400,
     "messages.0.content"),
    ("image_part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400,
     "messages.0.content.1"),
    ("bad_part_field", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": 3}}]}]}, 400,
     "messages.0.content.0.image_url.url"),
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


@pytest.mark.parametrize("path,body", [
    (COMP, {"prompt": "hello hello hello", "max_tokens": 3, "repetition_penalty": 5e-324,
            "logprobs": 3}),
    (COMP, {"prompt": "hello hello", "max_tokens": 2, "repetition_penalty": 1e-300,
            "logprobs": 2, "stream": True}),
    (GEN, {"text": "hi hi", "sampling_params": {"max_new_tokens": 3, "top_p": 0.5,
                                                "repetition_penalty": 1e-300},
           "return_logprob": True, "top_logprobs_num": 3})])
def test_extreme_valid_penalties_answer_with_finite_logprobs(server, path, body):
    """Regression (schema fuzz): a tiny repetition_penalty (valid: any r in (0, 2]) made
    seen tokens' logits +inf; the sampler returned the vocabulary size as a token id and the
    scheduler died on the next step; then -inf logprobs made a 500 (JSON has no -inf)."""
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert "Infinity" not in r.text and "NaN" not in r.text
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_server_survives_bad_input_without_leaks(server, client):
    assert httpx.get(server.base_url + "/health").status_code == 200
    r = client.completions.create(model="tiny", prompt="still alive", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    st = wait_idle(server)
    assert st["ok"] and st["num_used_tokens"] == 0, st


def test_image_part_says_images_are_not_supported(server):
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}
    r = httpx.post(server.base_url + CHAT, json=body, timeout=30)
    assert r.status_code == 400
    assert "image input is not supported" in r.json()["error"]["message"]


def test_duplicate_running_rid_is_a_400(server):
    """A rid equal to a running request's is the client's mistake: 400, and the running
    request is unharmed."""
    body = {"text": "hello", "rid": "dup-rid", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", GEN, json=body) as first:
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            second = httpx.post(server.base_url + GEN, json={**body, "stream": False},
                                timeout=30)
            assert second.status_code == 400, second.text
            assert second.json()["error"]["param"] == "rid"
            chunks = [line for line in lines if line.startswith("data:")]
    assert chunks[-1] == "data: [DONE]"
    assert '"length"' in chunks[-2]
    wait_idle(server)


def test_failed_batch_prompt_cancels_the_others(server):
    """One bad prompt in a /generate batch is a 400, and the batch's other prompts, already
    started, do not run on with nobody reading them (they are cancelled with the batch; the
    disconnect poll of the finished response would also catch them, 0.25 s later)."""
    from tests.e2e.test_sglang_router import finished_requests

    before = finished_requests(server.base_url)
    r = httpx.post(server.base_url + GEN, json={
        "input_ids": [[1] * 5, [1] * 600],
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids", r.text
    st = wait_idle(server, timeout=30)
    assert st["num_running_reqs"] == 0 and st["num_used_tokens"] == 0, st
    assert finished_requests(server.base_url) == before  # nothing ran to its end


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/models/..", 404),  # the client normalises it to /v1/ (schema fuzz)
    ("POST", "/v1/nope", 404), ("GET", "/v1/chat/completions", 405)])
def test_routing_errors_carry_the_openai_error_body(server, method, path, status):
    r = httpx.request(method, server.base_url + path, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if status == 405:
        assert "POST" in r.headers["allow"]
