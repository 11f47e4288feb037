"""Tool-call formats (entrypoints/tool_calls): each format's answers read whole, and the
property that matters for streaming -- however the text is cut into chunks, the streamed
content and tool_calls deltas add up to the non-streamed answer (hypothesis draws calls,
arguments, surrounding text and chunkings). KVSTRATA_FUZZ_EXAMPLES raises the count."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.config.server_args import TOOL_CALL_PARSERS as FLAG_CHOICES
from kvstrata.entrypoints.tool_calls import (DETECTORS, TOOL_CALL_PARSERS, ToolCallStream,
                                             json_array_detector, make_detector)
from kvstrata.entrypoints.tool_calls.partial_json import (ArgumentStreamer, dumps,
                                                          end_of_value, parse_prefix)

EXAMPLES = int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "150"))
TOOLS = frozenset({"get_weather", "get_time", "search.web"})
WEATHER = {"city": "Paris", "days": 3}


# The XML formats type a parameter's text by the tool's schema.
SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}, "get_time": {},
    "search.web": {}}


def _read(name: str, text: str):
    det = json_array_detector() if name == "array" else make_detector(name)
    scan = det.scan(text, True, SCHEMAS)
    return scan.normal, [(c.name, c.args) for c in scan.calls]


def test_flag_choices_are_the_built_formats():
    assert FLAG_CHOICES == TOOL_CALL_PARSERS
    for name in TOOL_CALL_PARSERS:
        make_detector(name)
    with pytest.raises(ValueError, match="unknown tool call parser"):
        make_detector("gpt-oss")


@pytest.mark.parametrize("name,text,normal,calls", [
    ("qwen25", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": '
               '"get_time", "arguments": {}}\n</tool_call>',
     "Let me check.\n", [("get_weather", WEATHER), ("get_time", {})]),
    # SmolLM2 writes a list inside one tag; "parameters" is read too
    ("hermes", '<tool_call>[{"name": "get_weather", "parameters": {"city": "Paris", '
               '"days": 3}}, {"name": "get_time"}]</tool_call>',
     "", [("get_weather", WEATHER), ("get_time", {})]),
    # an unknown tool is dropped, a block that is not JSON is skipped
    ("qwen25", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>\n'
               '<tool_call>\nnot json\n</tool_call>\n<tool_call>\n{"name": "get_time", '
               '"arguments": {}}\n</tool_call>', "", [("get_time", {})]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
               '"days": 3}}; {"name": "get_time", "parameters": {}}',
     "", [("get_weather", WEATHER), ("get_time", {})]),
    ("llama3", '{"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    ("mistral", 'Sure [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 3}}, {"name": "search.web", "arguments": {"q": "[a, b]"}}]',
     "Sure ", [("get_weather", WEATHER), ("search.web", {"q": "[a, b]"})]),
    ("deepseekv3", 'hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                   'get_weather\n```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>'
                   '\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```'
                   '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "hi", [("get_weather", WEATHER), ("get_time", {})]),
    ("kimi_k2", 'x<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
                '<|tool_call_begin|>functions.search.web:1<|tool_call_argument_begin|>'
                '{"q": "x"}<|tool_call_end|><|tool_calls_section_end|>',
     "x", [("get_weather", WEATHER), ("search.web", {"q": "x"})]),
    ("pythonic", 'See [1]. [get_weather(city="Paris", days=3), get_time()] done',
     "See [1].  done", [("get_weather", WEATHER), ("get_time", {})]),
    # a list that is not all literal calls is text
    ("pythonic", "[get_weather(city=x)] and [1, 2]", "[get_weather(city=x)] and [1, 2]", []),
    ("array", '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]', "",
     [("get_weather", WEATHER)]),
    ("qwen3_coder", 'Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis'
                    '\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n'
                    '</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>',
     "Let me see.\n", [("get_weather", WEATHER), ("get_time", {})]),
    ("glm45", 'ok<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
              '<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>'
              '<tool_call>get_time</tool_call>', "ok", [("get_weather", WEATHER),
                                                         ("get_time", {})]),
    # no marker: all text; a cut-off call (finish "length") is no call
    ("qwen25", "Just text about <tools>.", "Just text about <tools>.", []),
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"ci', "", []),
])
def test_read_whole_answer(name, text, normal, calls):
    assert _read(name, text) == (normal, calls)


def _run_stream(det, text: str, cuts: list[int], tools=TOOLS):
    stream = ToolCallStream(lambda t, final: det.scan(t, final, tools), lambda i, n: f"id{i}")
    content, calls = "", {}
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    parts = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [stream.finish()]
    for part in parts:
        content += part.content
        for item in part.tool_calls:
            call = calls.setdefault(item["index"], {"name": "", "arguments": "", "ids": []})
            call["name"] += item["function"].get("name", "")
            call["arguments"] += item["function"]["arguments"]
            if "id" in item:
                call["ids"].append(item["id"])
    assert all(c["ids"] == [f"id{i}"] for i, c in calls.items())  # one id, on the first
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


def test_stream_holds_back_a_marker_prefix():
    det = make_detector("qwen25")
    stream = ToolCallStream(lambda t, f: det.scan(t, f, TOOLS), lambda i, n: "id")
    assert stream.feed("Hello <tool").content == "Hello "
    assert stream.feed("s>").content == "<tools>"
    assert stream.feed(" <tool_c").content == " "
    assert stream.finish().content == "<tool_c"  # never became a marker


def test_stream_sends_name_then_arguments_as_they_settle():
    det = make_detector("qwen25")
    stream = ToolCallStream(lambda t, f: det.scan(t, f, TOOLS), lambda i, n: "call_1")
    assert stream.feed('<tool_call>\n{"name": "get_wea').tool_calls == []
    first = stream.feed('ther", "arguments": {"city": "Par').tool_calls
    assert first[0] == {"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert [d["function"]["arguments"] for d in first[1:]] == ['{"city": "Par']
    # a number may still grow (1 -> 1.5e3): held until something follows it
    assert stream.feed('is", "days": 1').tool_calls[0]["function"]["arguments"] == \
        'is", "days": '
    assert stream.feed('0}}\n</tool_call>').tool_calls[0]["function"]["arguments"] == "10}"
    assert stream.finish().tool_calls == []


# ---- the stream == whole property, per format ---------------------------------------------
_text = st.text(st.characters(codec="utf-8", exclude_characters="<[{|\x00"), max_size=12)
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False, width=32),
                    st.text(max_size=8))
_json = st.recursive(_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8)
_args = st.dictionaries(st.text(st.characters(codec="utf-8"), min_size=1, max_size=6),
                        _json, max_size=4)
_calls = st.lists(st.tuples(st.sampled_from(sorted(TOOLS | {"unknown_tool"})), _args),
                  min_size=1, max_size=3)


def _dump(value, ascii_: bool, spaced: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_,
                      separators=(", ", ": ") if spaced else (",", ":"))


def _render(name: str, calls, ascii_: bool, spaced: bool) -> str:
    d = lambda v: _dump(v, ascii_, spaced)  # noqa: E731
    if name == "qwen25":
        return "".join(f'<tool_call>\n{d({"name": n, "arguments": a})}\n</tool_call>\n'
                       for n, a in calls)
    if name == "llama3":
        return "<|python_tag|>" + "; ".join(d({"name": n, "parameters": a}) for n, a in calls)
    if name == "mistral":
        return "[TOOL_CALLS] " + d([{"name": n, "arguments": a} for n, a in calls])
    if name == "array":
        return d([{"name": n, "parameters": a} for n, a in calls])
    if name == "deepseekv3":
        return "<｜tool▁calls▁begin｜>" + "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{d(a)}\n```"
            "<｜tool▁call▁end｜>" for n, a in calls) + "<｜tool▁calls▁end｜>"
    if name == "kimi_k2":
        return "<|tool_calls_section_begin|>" + "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{d(a)}"
            "<|tool_call_end|>" for i, (n, a) in enumerate(calls)) + \
            "<|tool_calls_section_end|>"
    if name == "qwen3_coder":
        return "".join(f"<tool_call>\n<function={n}>\n" + "".join(
            f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in a.items())
            + "</function>\n</tool_call>\n" for n, a in calls)
    if name == "glm45":
        return "".join(f"<tool_call>{n}\n" + "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{_xml_value(v)}</arg_value>\n"
            for k, v in a.items()) + "</tool_call>" for n, a in calls)
    assert name == "pythonic"
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                           for n, a in calls) + "]"


def _xml_value(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number",
               type(None): "null", list: "array", dict: "object"}


def _xml_args(calls):
    """Parameters with tag-safe keys and text, and the schemas that type them back."""
    schemas, out = {}, []
    for n, a in calls:
        args = {f"p{i}": v.replace("<", "(") if isinstance(v, str) else v
                for i, v in enumerate(a.values())}
        props = schemas.setdefault(n, {"type": "object", "properties": {}})["properties"]
        for k, v in list(args.items()):
            kind = _JSON_TYPES[type(v)]
            if props.setdefault(k, {"type": kind})["type"] != kind:
                del args[k]  # one type per parameter
        out.append((n, args))
    return out, schemas


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(["qwen25", "llama3", "mistral", "array", "deepseekv3", "kimi_k2",
                             "pythonic", "qwen3_coder", "glm45"]),
       prefix=_text, calls=_calls, ascii_=st.booleans(), spaced=st.booleans(),
       cuts=st.lists(st.integers(0, 4000), max_size=40), data=st.data())
def test_stream_adds_up_to_the_whole_answer(name, prefix, calls, ascii_, spaced, cuts, data):
    if name == "pythonic":  # keyword names and Python literals only
        calls = [(n.replace(".", "_"), {f"k{i}": v for i, v in enumerate(a.values())
                                        if not isinstance(v, float)}) for n, a in calls]
    if name in ("array", "llama3") and prefix.strip():
        prefix = ""  # the bare array / unmarked JSON start the answer
    tools = TOOLS | {"search_web"}
    if name in ("qwen3_coder", "glm45"):
        calls, schemas = _xml_args(calls)
        tools = {n: schemas.get(n, {}) for n in tools}
    text = prefix + _render(name, calls, ascii_, spaced)
    det = json_array_detector() if name == "array" else make_detector(name)
    whole = det.scan(text, True, tools)
    # the whole read: the known tools' calls, in order, with their arguments
    assert [(c.name, c.args) for c in whole.calls] == [(n, a) for n, a in calls if n in tools]
    # cut the text at random places (a few random points near each marker too)
    if data.draw(st.booleans()):
        cuts = cuts + list(range(0, len(text), data.draw(st.integers(1, 5))))
    content, streamed = _run_stream(det, text, cuts, tools)
    assert streamed == [(c.name, dumps(c.args)) for c in whole.calls]
    assert content == (whole.normal if whole.calls else text)


# ---- partial JSON ---------------------------------------------------------------------------
@settings(max_examples=EXAMPLES, deadline=None)
@given(value=_args, ascii_=st.booleans(), spaced=st.booleans())
def test_argument_deltas_add_up_to_the_final_arguments(value, ascii_, spaced):
    raw = _dump(value, ascii_, spaced)
    streamer, sent = ArgumentStreamer(), ""
    for end in range(1, len(raw)):
        try:
            partial, complete = parse_prefix(raw[:end])
        except ValueError:
            continue
        if not complete:
            sent += streamer.update(partial)
            assert dumps(value).startswith(sent)
    sent += streamer.finish(value)
    assert sent == dumps(value)


def test_end_of_value():
    assert end_of_value('  {"a": [1, "x]"]} tail') == 18
    for unfinished in ('{"a": 1', '{"a": "b', '{"a": tr', '{"a": -', '{"a": 1.', ""):
        assert end_of_value(unfinished) is None, unfinished
    with pytest.raises(ValueError):
        end_of_value('{"a" x')


def test_every_detector_answers_plain_text_as_text():
    for name in DETECTORS:
        det = make_detector(name)
        text = "A plain answer, with (parentheses) and a {brace}."
        assert det.scan(text, True, TOOLS).calls == [], name
