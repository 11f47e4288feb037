"""One smoke test on the real default model (SmolLM2-135M-Instruct, GGUF): a plain answer and
a JSON-schema one."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.server_utils import ServerProcess, ask_capital_of_france


@pytest.mark.slow
def test_capital_of_france():
    srv = ServerProcess("smollm2-135m", "--max-total-tokens", "8192", timeout=300)
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
    finally:
        srv.stop()
