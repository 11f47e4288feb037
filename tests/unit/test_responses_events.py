"""The Responses API's stream events from chat deltas (entrypoints/api/responses_stream.py):
each output item opens, grows and closes in order, and response.completed carries the items
the events built -- reasoning, then text, then function calls."""
from __future__ import annotations

import json

from kvstrata.entrypoints.api.responses_api import ResponsesRequest
from kvstrata.entrypoints.api.responses_stream import ResponsesEvents


class _Out:
    prompt_tokens, completion_tokens, cached_tokens = 5, 9, 0


def _events(chunks: list[bytes]) -> list[dict]:
    out = []
    for chunk in chunks:
        for block in chunk.decode().strip().split("\n\n"):
            kind, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert kind == "event: " + event["type"]
            out.append(event)
    return out


def test_items_open_grow_and_close_in_order():
    body = ResponsesRequest.model_validate({"input": "hi"}, strict=False)
    ev = ResponsesEvents({"id": "resp_1"})
    chunks = ev.start()
    for delta in ({"reasoning_content": "Hmm"}, {"reasoning_content": "."},
                  {"content": "Calling."},
                  {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "f", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "type": "function",
                                   "function": {"arguments": '{"a": '}}]},
                  {"tool_calls": [{"index": 0, "type": "function",
                                   "function": {"arguments": "1}"}}]}):
        chunks += ev.feed(delta)
    chunks += ev.finish(body, "resp_1", "m", 0, "tool_calls", _Out())
    events = _events(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hmm."
    assert final["output"][1]["content"][0]["text"] == "Calling."
    assert final["output"][2]["arguments"] == '{"a": 1}'
    assert final["output"][2]["call_id"] == "call_1"
    assert final["output"][2]["status"] == "completed"
    assert final["usage"]["output_tokens"] == 9 and final["status"] == "completed"
