"""What a tool-call detector reports, and the JSON family of formats.

A detector reads a model's whole output so far (`scan(text, final)`) and says which part is
plain text and which tool calls it holds. One function serves both ends: a response parses
the finished text (`final=True`), a stream scans the text after every chunk and sends what
changed (streaming.py). So a stream adds up to the non-streamed answer by construction, with
one rule for the partial scans: their plain text and each call's name only ever grow, never
change (text that may still become a marker is held back; a name is reported once its string
is closed).

Calls naming a tool the request does not offer are dropped, as SGLang drops them. `tools`
is the offered names (a dict name -> parameters schema, which the XML formats type values
by).
"""
from __future__ import annotations

import json
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import jiter

from kvstrata.entrypoints.tool_calls.partial_json import end_of_value, parse_prefix


@dataclass
class ScannedCall:
    name: str
    args: Any = None  # the parsed arguments (a partial value until complete); None: not yet
    complete: bool = False


@dataclass
class Scan:
    normal: str = ""
    calls: list[ScannedCall] = field(default_factory=list)


@dataclass(frozen=True)
class StructureInfo:
    """How one tool's call starts and ends in the model's format, and the text that opens
    a call section (SGLang's structural tag under tool_choice auto with strict tools)."""
    begin: str
    end: str
    trigger: str


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`: text a
    stream must hold back, since the next chunk may complete the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def call_of(obj: Any, tools: Container[str], complete: bool) -> ScannedCall | None:
    """A call from one JSON object {"name": ..., "arguments" | "parameters": ...}; None when it
    has no (finished) name or names an unknown tool. Arguments default to {} once the
    object is complete (a call without them takes none)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in tools:
        return None
    if obj.get("parameters"):  # SGLang: parameters wins when non-empty
        args = obj["parameters"]
    else:
        args = obj.get("arguments", {} if complete else None)
        if args is None and obj.get("parameters") is not None:
            args = obj["parameters"]
    return ScannedCall(name, args, complete)


def _calls_of(value: Any, tools: Container[str], complete: bool,
              names_done: Any) -> list[ScannedCall]:
    """Calls in one JSON value (an object, or an array of them as Mistral and SmolLM2
    write). `names_done` is the same prefix parsed without unfinished strings: a name is
    reported only where it is whole there."""
    items = value if isinstance(value, list) else [value]
    done = names_done if isinstance(names_done, list) else [names_done]
    calls = []
    for k, item in enumerate(items):
        item_complete = complete or k < len(items) - 1
        whole = done[k] if k < len(done) and isinstance(done[k], dict) else {}
        if not item_complete and isinstance(item, dict) and whole.get("name") != \
                item.get("name"):
            continue  # its name is still being written
        call = call_of(item, tools, item_complete)
        if call is not None:
            calls.append(call)
    return calls


def _names_done(text: str) -> Any:
    try:
        return jiter.from_json(text.strip().encode(), partial_mode="on")
    except ValueError:
        return None


class JsonCallsDetector:
    """Calls written as JSON objects after a marker: `bot` value `eot`, repeated (Qwen /
    Hermes `<tool_call>`), values joined by `sep` after one marker (Llama 3's
    `<|python_tag|>` and `;`), or one JSON array of calls (Mistral's `[TOOL_CALLS]`; the
    bare array that tool_choice required / named constrains to). Whitespace around
    markers is free. Text after the calls is dropped (as SGLang's Qwen and DeepSeek)."""

    def __init__(self, bot: str, eot: str = "", sep: str | None = None,
                 bare_start: str | None = None, begin: str = "", end: str = ""):
        self.bot, self.eot, self.sep = bot, eot, sep
        self.bare_start = bare_start  # a call section may also open with this, unmarked
        self.begin, self.end = begin, end  # structure_info around '{"name":"X", "arguments":'

    def structure_info(self, name: str) -> StructureInfo | None:
        if not self.bot:
            return None
        return StructureInfo(self.begin.replace("NAME", name), self.end, self.bot.strip())

    def _section_start(self, text: str) -> tuple[int, int] | None:
        """(start of the marker, start of the first value) of the call section."""
        if self.bot:
            pos = text.find(self.bot)
            if pos >= 0:
                return pos, pos + len(self.bot)
        if self.bare_start is not None and text.lstrip().startswith(self.bare_start):
            return 0, len(text) - len(text.lstrip())
        return None

    def scan(self, text: str, final: bool, tools: Container[str]) -> Scan:
        section = self._section_start(text)
        if section is None:
            if final or not self.bot:
                return Scan(normal=text)
            keep = held_prefix(text, self.bot)
            if self.bare_start is not None and not text.strip():
                keep = len(text)  # whitespace: an unmarked section may still follow
            return Scan(normal=text[:len(text) - keep])
        marker_at, i = section
        scan = Scan(normal=text[:marker_at])
        while (i := _skip_ws(text, i)) < len(text):
            try:
                end = end_of_value(text, i)
            except ValueError:  # not JSON: skip the block if its end marker closes it
                close = text.find(self.eot.strip(), i) if self.eot else -1
                i = None if close < 0 else self._next_value(text, close)
                if i is None:
                    break
                continue
            if end is None:
                self._partial(text[i:], final, tools, scan)
                break
            value = json.loads(text[i:end])
            scan.calls.extend(_calls_of(value, tools, True, value))
            i = self._next_value(text, end)
            if i is None:
                break
        return scan

    def _partial(self, rest: str, final: bool, tools: Container[str], scan: Scan) -> None:
        """The last value is unfinished: its calls so far in a stream; at the end, dropped
        (the output was cut short)."""
        if final:
            return
        try:
            value, _ = parse_prefix(rest)
        except ValueError:
            return
        scan.calls.extend(_calls_of(value, tools, False, _names_done(rest)))

    def _next_value(self, text: str, end: int) -> int | None:
        """Where the next call's value starts after a value ending at `end`, or None."""
        i = _skip_ws(text, end)
        if self.eot and text.startswith(self.eot.strip(), i):
            i = _skip_ws(text, i + len(self.eot.strip()))
        if self.sep and text.startswith(self.sep, i):
            return i + len(self.sep)
        marker = self.bot.strip()
        if marker and self.eot and text.startswith(marker, i):
            return i + len(marker)
        return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i

