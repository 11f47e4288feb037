"""A chat request's tools / tool_choice (entrypoints/api/tool_choice.py): what the template
is shown, the constraint for required / named / strict, ids, and the messages that carry
earlier calls and their results into a Qwen-style template."""
from __future__ import annotations

import json

import jinja2
import pytest

from kvstrata.entrypoints.api.chat_prompt import chat_prompt_ids
from kvstrata.entrypoints.api.errors import ApiError
from kvstrata.entrypoints.api.openai_protocol import ChatCompletionRequest
from kvstrata.entrypoints.api.tool_choice import plan_tools
from kvstrata.protocol.grammar import grammar_error

MSG = [{"role": "user", "content": "hi"}]
DEFS = {"Unit": {"enum": ["C", "F"]}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city"], "$defs": DEFS}}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True}}


class Args:
    tool_call_parser = "qwen25"


def _plan(parser: str | None = "qwen25", **body):
    args = Args()
    args.tool_call_parser = parser
    req = ChatCompletionRequest.model_validate({"messages": MSG, **body}, strict=False)
    return plan_tools(args, req)


def test_none_and_no_tools_show_and_read_nothing():
    assert _plan() is None
    assert _plan(tools=[WEATHER], tool_choice="none") is None
    assert _plan(tools=[], tool_choice="auto") is None


def test_auto_shows_all_tools_and_reads_the_models_format():
    plan = _plan(tools=[WEATHER, TIME])
    assert [t["function"]["name"] for t in plan.template_tools] == ["get_weather", "get_time"]
    assert plan.template_tools[1] == {"type": "function",
                                      "function": {"name": "get_time", "strict": True}}
    assert plan.detector is not None and plan.array_detector is None
    # a strict tool: a structural tag in Qwen's format, its schema for strict tools only
    tag = json.loads(plan.constraint["structural_tag"])
    assert tag["triggers"] == ["<tool_call>"]
    assert [s["begin"] for s in tag["structures"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "get_time", "arguments": ']
    assert tag["structures"][0]["schema"] == {}
    assert tag["structures"][1]["schema"] == {"type": "object", "properties": {}}
    assert grammar_error("structural_tag", plan.constraint["structural_tag"]) == ""
    assert _plan(tools=[WEATHER]).constraint == {}  # nothing strict: free text
    assert _plan(parser=None, tools=[WEATHER]).detector is None  # no parser: text back


def test_required_constrains_to_a_json_array_of_calls():
    plan = _plan(tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(plan.constraint["json_schema"])
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == DEFS  # hoisted: "#/$defs/Unit" resolves at the root
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert "$defs" not in first["properties"]["parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert grammar_error("json_schema", plan.constraint["json_schema"]) == ""
    one = json.loads(_plan(tools=[WEATHER], tool_choice="required",
                           parallel_tool_calls=False).constraint["json_schema"])
    assert one["maxItems"] == 1
    content, calls = plan.read('[{"name": "get_time", "parameters": {}}]', True)
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert calls[0]["id"].startswith("call_") and len(calls[0]["id"]) == 29
    # the client's own grammar took the constraint's place: read in the model's format
    assert plan.read('[{"name": "get_time", "parameters": {}}]', False) == (
        '[{"name": "get_time", "parameters": {}}]', None)


def test_named_shows_and_allows_only_that_tool():
    plan = _plan(parser=None, tools=[WEATHER, TIME],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [t["function"]["name"] for t in plan.template_tools] == ["get_weather"]
    schema = json.loads(plan.constraint["json_schema"])
    assert schema["maxItems"] == 1
    assert schema["items"]["properties"]["name"]["enum"] == ["get_weather"]
    # read even without --tool-call-parser (the array is our format, not the model's)
    _, calls = plan.read('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', True)
    assert calls[0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_conflicting_defs_are_refused():
    other = json.loads(json.dumps(WEATHER))
    other["function"]["name"] = "other"
    other["function"]["parameters"]["$defs"] = {"Unit": {"enum": ["K"]}}
    with pytest.raises(ApiError, match="Tool definition 'Unit' has multiple schemas"):
        _plan(tools=[WEATHER, other], tool_choice="required")


def test_kimi_ids_count_the_historys_calls():
    history = MSG + [{"role": "assistant", "tool_calls": [
        {"id": "functions.get_time:0", "type": "function",
         "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "noon"}]
    plan = _plan(parser="kimi_k2", tools=[TIME], messages=history)
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
            "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
    assert plan.read(text, False)[1][0]["id"] == "functions.get_time:1"


def test_mistral_ids_are_nine_characters():
    """Mistral's chat templates refuse tool call ids that are not 9 alphanumerics."""
    plan = _plan(parser="mistral", tools=[TIME])
    _, calls = plan.read('[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', False)
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()


# A Qwen 2.5-style template: tools as JSON, earlier calls with their arguments as objects.
QWEN_LIKE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}<|assistant|>")


class FakeTM:
    """The tokenizer manager's template step, rendering to characters (one id each)."""

    def __init__(self, template: str):
        self.template = jinja2.Environment().from_string(template)
        self.tokenizer = self
        self.rendered = ""

    def apply_chat_template(self, messages, tools=None, **kwargs):
        self.rendered = self.template.render(messages=messages, tools=tools, **kwargs)
        return [ord(c) for c in self.rendered]

    def encode_prompt(self, text):
        return [ord(c) for c in text]


def test_template_gets_tools_calls_and_results():
    body = ChatCompletionRequest.model_validate({"messages": MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}],
        "tools": [TIME]}, strict=False)
    tm = FakeTM(QWEN_LIKE)
    chat_prompt_ids(tm, body, plan_tools(Args(), body).template_tools)
    assert tm.rendered == (
        '<tools>{"function": {"name": "get_time", "strict": true}, "type": "function"}</tools>\n'
        "<|user|>hi\n"
        '<|assistant|><tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>\n'
        "<|tool|>noon[call_1]\n<|assistant|>")


def test_template_that_reads_bare_functions_gets_them():
    """SGLang's fallback: a template that fails on {"type", "function"} items gets the
    function objects."""
    tm = FakeTM("{% for t in tools %}{{ t.name.upper() }}{% endfor %}")
    body = ChatCompletionRequest.model_validate({"messages": MSG, "tools": [TIME]},
                                                strict=False)
    chat_prompt_ids(tm, body, plan_tools(Args(), body).template_tools)
    assert tm.rendered == "GET_TIME"


# ---- --chat-template ------------------------------------------------------------------------
def test_chat_template_from_a_file_or_text(tmp_path):
    from kvstrata.frontend.tokenizer_loader import chat_template_text

    path = tmp_path / "tools.jinja"
    path.write_text(QWEN_LIKE)
    assert chat_template_text(str(path)) == QWEN_LIKE
    assert chat_template_text(QWEN_LIKE) == QWEN_LIKE
    with pytest.raises(ValueError, match="--chat-template: cannot read '/nope.jinja'"):
        chat_template_text("/nope.jinja")
    with pytest.raises(ValueError, match="--chat-template: not a Jinja template"):
        chat_template_text("{% for m in messages %}")


def test_serve_refuses_a_bad_chat_template_at_once(capsys):
    from kvstrata.entrypoints.cli import main

    assert main(["serve", "--model-path", "x", "--chat-template", "/nope.jinja"]) == 2
    assert "--chat-template: cannot read '/nope.jinja'" in capsys.readouterr().err


def test_the_tokenizer_takes_the_chat_template():
    """SmolLM2's own template does not show tools; one given by --chat-template does."""
    from types import SimpleNamespace

    from kvstrata.frontend.tokenizer_loader import load_tokenizer_for

    args = SimpleNamespace(model_path="smollm2-135m", chat_template=QWEN_LIKE)
    tok = load_tokenizer_for(args)
    text = tok.apply_chat_template(MSG, tools=[TIME], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith('<tools>{"type": "function", "function": {"name": "get_time"')


def test_reasoning_effort_is_a_template_variable():
    tm = FakeTM("effort={{ reasoning_effort }}")
    body = ChatCompletionRequest.model_validate({"messages": MSG, "reasoning_effort": "low"},
                                                strict=False)
    chat_prompt_ids(tm, body)
    assert tm.rendered == "effort=low"
    body = ChatCompletionRequest.model_validate({"messages": MSG, "reasoning_effort": "low",
                                                 "chat_template_kwargs": {
                                                     "reasoning_effort": "high"}},
                                                strict=False)
    chat_prompt_ids(tm, body)
    assert tm.rendered == "effort=high"  # the client's chat_template_kwargs win
