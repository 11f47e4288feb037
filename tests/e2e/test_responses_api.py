"""/v1/responses through the official openai client (client.responses.create) on the shared
tiny server: text input and instructions, a conversation of input items with a function
call and its output, function tools (tool_choice required -> function_call items), a JSON
schema text format, max_output_tokens -> status incomplete, and the refused fields."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.test_tool_calling import TIME, WEATHER


def _flat(tool: dict) -> dict:
    """A chat tool in the Responses API's flat form."""
    return {"type": "function", **tool["function"]}


def test_text_answer_equals_the_chat_answer(client):
    r = client.responses.create(model="tiny", input="Say something.", instructions="Be brief.",
                                max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}])
    assert r.output_text == chat.choices[0].message.content
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                        else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_function_tools_give_function_call_items(client):
    r = client.responses.create(model="tiny", input="Weather in Paris?", max_output_tokens=60,
                                tools=[_flat(WEATHER), _flat(TIME)], tool_choice="required",
                                parallel_tool_calls=False, temperature=1.0,
                                extra_body={"seed": 2})
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    assert calls[0].name in ("get_weather", "get_time") and calls[0].call_id.startswith("call_")
    json.loads(calls[0].arguments)
    # the call and its output go back as input items
    follow = client.responses.create(model="tiny", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=[_flat(WEATHER), _flat(TIME)], tool_choice="none")
    assert follow.status in ("completed", "incomplete") and follow.output
    named = client.responses.create(model="tiny", input="Time?", max_output_tokens=60,
                                    tools=[_flat(WEATHER), _flat(TIME)], temperature=0,
                                    tool_choice={"type": "function", "name": "get_time"})
    assert [i.name for i in named.output if i.type == "function_call"] == ["get_time"]


def test_json_schema_text_format(client):
    schema = {"type": "object", "x-guidance": {"whitespace_flexible": False},
              "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny", input="Is it ok?", max_output_tokens=20,
                                temperature=0, text={"format": {
                                    "type": "json_schema", "name": "ok", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["ok"], bool)


def _streamed(client, **kwargs):
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    return events, events[-1].response


def test_stream_events_add_up_to_the_response(client):
    kwargs = dict(model="tiny", input="Say something.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events, final = _streamed(client, **kwargs)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text
    assert events[-1].type == ("response.incomplete" if whole.status == "incomplete"
                               else "response.completed")
    kinds = [e.type for e in events]
    assert kinds.index("response.output_item.added") < kinds.index(
        "response.content_part.added") < kinds.index("response.output_text.delta")
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]


def test_stream_function_call_events(client):
    kwargs = dict(model="tiny", input="Weather?", max_output_tokens=60, temperature=1.0,
                  tools=[_flat(WEATHER), _flat(TIME)], tool_choice="required",
                  parallel_tool_calls=False, extra_body={"seed": 5})
    whole = client.responses.create(**kwargs)
    events, final = _streamed(client, **kwargs)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"]
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    call = [i for i in whole.output if i.type == "function_call"][0]
    assert args == done.arguments == call.arguments and done.name == call.name
    assert final.status == "completed" and final.output[0].arguments == call.arguments


@pytest.mark.parametrize("body,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    # the chat route's checks, naming this request's fields
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
     "text.format"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input"),
    # a tool's output that answers no call of the input (OpenAI's 400; issue 59)
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input"),
    ({"tool_choice": "bogus"}, "tool_choice"),
])
def test_refused_fields_are_400(server, body, param):
    r = httpx.post(server.base_url + "/v1/responses", timeout=30,
                   json={"model": "tiny", "input": "hi", "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_openai_client_error_type(client):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_x")
