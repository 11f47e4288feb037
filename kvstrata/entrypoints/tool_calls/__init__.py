"""Tool calling: the model's tool-call formats (SGLang's --tool-call-parser names, vLLM's as
aliases) and the constraints of tool_choice. Pure text work for the API server: it reads
what the model wrote; the grammar engine (structured output) keeps it inside a format."""
from __future__ import annotations

from kvstrata.entrypoints.tool_calls.core import JsonCallsDetector, Scan, ScannedCall
from kvstrata.entrypoints.tool_calls.formats import PythonicDetector, deepseek_v3, kimi_k2
from kvstrata.entrypoints.tool_calls.formats_xml import Glm45Detector, Qwen3CoderDetector
from kvstrata.entrypoints.tool_calls.streaming import StreamDelta, ToolCallStream

_QWEN_BEGIN = '<tool_call>\n{"name": "NAME", "arguments": '

# SGLang's parser names -> a detector factory.
DETECTORS = {
    # Qwen 2.5 / 3, Hermes, SmolLM2-style: <tool_call>{"name": .., "arguments": ..}</tool_call>
    "qwen25": lambda: JsonCallsDetector("<tool_call>", "</tool_call>", begin=_QWEN_BEGIN,
                                        end="}\n</tool_call>"),
    "qwen": lambda: DETECTORS["qwen25"](),
    "hermes": lambda: JsonCallsDetector(
        "<tool_call>", "</tool_call>", begin='<tool_call>{"name": "NAME", "arguments": ',
        end="}</tool_call>"),
    # Llama 3.1-3.3 JSON: <|python_tag|>{"name": .., "parameters": ..}; ... (or bare JSON)
    "llama3": lambda: JsonCallsDetector(
        "<|python_tag|>", sep=";", bare_start="{",
        begin='<|python_tag|>{"name": "NAME", "arguments": ', end="}"),
    # Mistral: [TOOL_CALLS] [{"name": .., "arguments": ..}, ...]
    "mistral": lambda: JsonCallsDetector(
        "[TOOL_CALLS]", begin='[TOOL_CALLS] [{"name": "NAME", "arguments": ', end="}]"),
    "deepseekv3": deepseek_v3,
    "kimi_k2": kimi_k2,
    "pythonic": PythonicDetector,
    # Qwen3-Coder: <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function>
    "qwen3_coder": Qwen3CoderDetector,
    # GLM-4.5 / 4.6 / 4.7: <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>
    "glm45": Glm45Detector,
    "glm": Glm45Detector,
    "glm47": Glm45Detector,
}
# vLLM's names for the same formats.
ALIASES = {"llama3_json": "llama3", "deepseek_v3": "deepseekv3", "llama4_pythonic": "pythonic",
           "qwen3_xml": "qwen3_coder"}
TOOL_CALL_PARSERS = tuple(DETECTORS) + tuple(ALIASES)


def make_detector(name: str):
    factory = DETECTORS.get(ALIASES.get(name, name))
    if factory is None:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(TOOL_CALL_PARSERS)}")
    return factory()


def read_calls(detector, text: str, tools) -> tuple[str | None, list[ScannedCall]]:
    """A finished answer read by `detector`: (its text beside the calls, stripped, None if
    empty; the calls). Without a call the whole text is the content: (text, [])."""
    scan = detector.scan(text, True, tools)
    if not scan.calls:
        return text, []
    return scan.normal.strip() or None, scan.calls


def json_array_detector() -> JsonCallsDetector:
    """The bare JSON array [{"name": .., "parameters": ..}, ...] that tool_choice required /
    named constrains the output to (whatever the model's own format)."""
    return JsonCallsDetector("", bare_start="[")


__all__ = ["DETECTORS", "TOOL_CALL_PARSERS", "Scan", "ScannedCall", "StreamDelta",
           "ToolCallStream", "json_array_detector", "make_detector", "read_calls"]
