"""One smoke test on the real default model (SmolLM2-135M-Instruct, GGUF): a plain answer, a
JSON-schema one, and tool calls under tool_choice required (the model picks the tool)."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.server_utils import ServerProcess, ask_capital_of_france


@pytest.mark.slow
def test_capital_of_france():
    srv = ServerProcess("smollm2-135m", "--max-total-tokens", "8192",
                        "--tool-call-parser", "hermes", timeout=300)
    try:
        answer = ask_capital_of_france(srv)
        assert "Paris" in answer, answer
        # structured output on the real model: a JSON answer of the schema
        schema = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "country": {"type": "string"}},
                  "required": ["city", "country"], "additionalProperties": False}
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France? "
                          "Answer in JSON with city and country."}],
            "temperature": 0, "max_tokens": 60, "response_format": {
                "type": "json_schema", "json_schema": {"name": "capital", "schema": schema}}})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"city", "country"} and "Paris" in value["city"], value
        _check_tool_calls(srv)
    finally:
        srv.stop()


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}},
         {"type": "function", "function": {
             "name": "get_time", "description": "Get the time in a timezone",
             "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                            "required": ["timezone"]}}}]


def _check_tool_calls(srv) -> None:
    for question, name, key, value in (("What's the weather like in Paris?", "get_weather",
                                        "city", "Paris"),
                                       ("What time is it in Tokyo?", "get_time", "timezone",
                                        "Tokyo")):
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": question}], "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
            "max_tokens": 60})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        call = choice["message"]["tool_calls"][0]["function"]
        assert call["name"] == name and value in json.loads(call["arguments"])[key], call
