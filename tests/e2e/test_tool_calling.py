"""Tool calling through the server with the official openai client (the shared tiny server:
random weights, SmolLM2's tokenizer, --tool-call-parser qwen25).

tool_choice required / named constrain the answer, so even random weights call a tool with
arguments of its schema. For "auto" the model must write Qwen's <tool_call> format itself:
a client regex holds it to a few such answers (the regex is the client's grammar, so the
server reads the answer as the model's own), sampled with seeds. A streamed answer adds up
to the non-streamed one with the same seed."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
# Compact JSON (llguidance's per-schema option; a tool's moves to the whole constraint):
# a random model under the default would mostly draw whitespace.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "x-guidance": {"whitespace_flexible": False},
        "properties": {"city": {"type": "string", "maxLength": 10},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "x-guidance": {"whitespace_flexible": False},
    "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
# "auto": answers in Qwen's format (0-2 calls, text before, one unknown tool)
AUTO_REGEX = (r'(Sure\. |Checking: )?<tool_call>\n\{"name": "get_weather", "arguments": '
              r'\{"city": "(Paris|Rome)", "days": [1-3]\}\}\n</tool_call>'
              r'(\n<tool_call>\n\{"name": "(get_time|nope)", "arguments": \{"tz": "UTC"\}\}'
              r'\n</tool_call>)?|No tool needed\.')


def _check_call(call) -> dict:
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    if call.function.name == "get_weather":
        assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7
        assert isinstance(args["city"], str) and len(args["city"]) <= 10
    else:
        assert call.function.name == "get_time" and args in ({"tz": "UTC"}, {"tz": "CET"})
    return args


def _streamed(client, **kwargs):
    """(content, [(name, arguments)], finish_reason) assembled from a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for item in choice.delta.tool_calls or []:
            call = calls.setdefault(item.index, ["", ""])
            if item.id is not None:
                assert item.function.name and not call[0]  # the first delta names it
            call[0] += item.function.name or ""
            call[1] += item.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_call_a_tool(client, choice):
    tool_choice = {"type": "function", "function": {"name": "get_time"}} \
        if choice == "named" else "required"
    for seed in range(3):
        kwargs = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice=tool_choice,
                      parallel_tool_calls=False, max_tokens=60, temperature=1.0, seed=seed)
        r = client.chat.completions.create(**kwargs)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert len(c.message.tool_calls) == 1
        _check_call(c.message.tool_calls[0])
        if choice == "named":
            assert c.message.tool_calls[0].function.name == "get_time"
        streamed = _streamed(client, **kwargs)
        call = c.message.tool_calls[0].function
        assert streamed == ("", [(call.name, call.arguments)], "tool_calls")


def test_required_allows_several_calls_and_n(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS,
                                       tool_choice="required", max_tokens=200, n=3,
                                       temperature=1.0, seed=7)
    for c in r.choices:
        if c.finish_reason == "length":  # cut inside the array: its text, no calls
            assert c.message.tool_calls is None and c.message.content.startswith("[")
            continue
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        assert [t.index for t in c.message.tool_calls] == list(range(len(
            c.message.tool_calls)))
        for call in c.message.tool_calls:
            _check_call(call)


def test_auto_reads_the_models_format(client):
    seen = set()
    for seed in range(8):
        kwargs = dict(model="tiny", messages=MSG, tools=TOOLS, max_tokens=80,
                      temperature=1.0, seed=seed, extra_body={"regex": AUTO_REGEX})
        c = client.chat.completions.create(**kwargs).choices[0]
        calls = c.message.tool_calls or []
        if not calls:
            assert c.message.content == "No tool needed." and c.finish_reason == "stop"
        else:
            assert c.finish_reason == "tool_calls"
            assert c.message.content in (None, "Sure.", "Checking:")
            assert calls[0].function.name == "get_weather"
            assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")
            assert all(call.function.name != "nope" for call in calls)  # unknown: dropped
        seen.add(len(calls))
        content, streamed, finish = _streamed(client, **kwargs)
        assert finish == c.finish_reason
        assert content.strip() == (c.message.content or "")
        assert streamed == [(t.function.name, t.function.arguments) for t in calls]
    assert len(seen) >= 2  # answers with different numbers of calls were read


def test_auto_without_a_call_is_text(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=12,
                                       temperature=0)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
    plain = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12,
                                           temperature=0).choices[0]
    # SmolLM2's template does not show tools: the same answer as without them
    assert c.message.content == plain.message.content


def test_a_conversation_with_tool_results(client):
    """An assistant turn of only tool calls (no content) and the tool's answer go back in."""
    messages = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                       tool_choice="none", max_tokens=5, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("body,param,message", [
    ({"tool_choice": "required"}, "tool_choice",
     "Tools cannot be empty if tool choice is set to required."),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "Tools cannot be empty if tool choice is set to a specific tool."),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "Tool 'nope' not found in tools list."),
    ({"tools": [TIME, TIME]}, "tools", "tools: function name 'get_time' is given twice"),
    ({"tools": TOOLS, "tool_choice": "required", "messages": MSG + [
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "get_time", "arguments": "{not json"}}]}]},
     "messages.1.tool_calls.0.function.arguments",
     "messages.1.tool_calls.0.function.arguments must be valid JSON"),
    ({"messages": [{"role": "user"}]}, "messages.0.content",
     "messages.0.content is required (only an assistant message with tool_calls may omit "
     "it)"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
      "tool_choice": "required"}, "tools", None),
])
def test_bad_tool_requests_are_400(server, body, param, message):
    r = httpx.post(server.base_url + CHAT, timeout=30,
                   json={"model": "tiny", "messages": MSG, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if message is not None:
        assert err["message"] == message
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_openai_client_types_round_trip(client):
    """The client's own ChatCompletionMessage (tool_calls and all) goes back as a message."""
    first = client.chat.completions.create(
        model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=1.0, seed=3).choices[0]
    call = first.message.tool_calls[0]
    messages = MSG + [first.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                            max_tokens=4, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MSG, tool_choice="required",
                                       max_tokens=4)


def test_parse_function_call_route(server):
    """SGLang's /parse_function_call: any format, whatever the server's own parser."""
    text = ('Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}, '
            '{"name": "nope", "arguments": {}}]')
    r = httpx.post(server.base_url + "/parse_function_call", timeout=30, json={
        "text": text, "tool_call_parser": "mistral", "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json() == {"normal_text": "Sure.", "calls": [
        {"tool_index": 1, "name": "get_time", "parameters": '{"tz": "UTC"}'}]}
    plain = httpx.post(server.base_url + "/parse_function_call", timeout=30, json={
        "text": "no call", "tool_call_parser": "qwen25", "tools": TOOLS}).json()
    assert plain == {"normal_text": "no call", "calls": []}
    bad = httpx.post(server.base_url + "/parse_function_call", timeout=30, json={
        "text": "x", "tool_call_parser": "gpt-oss"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_call_parser"


def test_an_answer_without_calls_ends_without_its_eos(client):
    """With a tool-call parser the reader needs special tokens (skip_special_tokens is off);
    the EOS the answer stopped at is still not text (found by the load fuzz: a grammar's
    answer under tools ended in '<|im_end|>')."""
    for stream in (False, True):
        kwargs = dict(model="tiny", messages=MSG, tools=TOOLS, max_tokens=20, temperature=0,
                      extra_body={"regex": r"No tool needed\."})
        if stream:
            content, calls, finish = _streamed(client, **kwargs)
        else:
            c = client.chat.completions.create(**kwargs).choices[0]
            content, calls, finish = c.message.content, c.message.tool_calls, c.finish_reason
        assert (content, calls or None, finish) == ("No tool needed.", None, "stop")
