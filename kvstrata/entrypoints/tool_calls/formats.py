"""Tool-call formats that are not plain JSON objects: DeepSeek-V3's and Kimi-K2's special
tokens around a name and JSON arguments, and Llama's pythonic call lists. Each scans like
core.JsonCallsDetector (whole text so far, `final` at the end)."""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Container

from kvstrata.entrypoints.tool_calls.core import (Scan, ScannedCall, StructureInfo,
                                                  held_prefix)
from kvstrata.entrypoints.tool_calls.partial_json import end_of_value, parse_prefix


class TaggedCallsDetector:
    """A call section opened by `bot`; each call is `call_begin` HEADER `args_begin` JSON
    `args_end`, the tool's name read from HEADER by `name_re` (group "name")."""

    def __init__(self, bot: str, call_begin: str, args_begin: str, args_end: str,
                 name_re: str, begin: str, end: str):
        self.bot, self.call_begin, self.args_begin = bot, call_begin, args_begin
        self.args_end = args_end
        self.name_re = re.compile(name_re, re.S)
        self.begin, self.end = begin, end

    def structure_info(self, name: str) -> StructureInfo:
        return StructureInfo(self.begin.replace("NAME", name), self.end, self.bot)

    def scan(self, text: str, final: bool, tools: Container[str]) -> Scan:
        pos = text.find(self.bot)
        if pos < 0:
            keep = 0 if final else held_prefix(text, self.bot)
            return Scan(normal=text[:len(text) - keep])
        scan = Scan(normal=text[:pos])
        i = pos + len(self.bot)
        while (start := text.find(self.call_begin, i)) >= 0:
            head_at = start + len(self.call_begin)
            args_at = text.find(self.args_begin, head_at)
            if args_at < 0:
                break  # the header (the name) is still being written
            match = self.name_re.fullmatch(text[head_at:args_at])
            i = args_at + len(self.args_begin)
            try:
                end = end_of_value(text, i)
            except ValueError:
                end = -1  # not JSON: the call is dropped
            known = match is not None and match["name"] in tools
            if end is None:  # unfinished arguments
                if known and not final:
                    scan.calls.append(ScannedCall(match["name"], _partial(text[i:])))
                break
            if end < 0:
                close = text.find(self.args_end, i)
                if close < 0:
                    break
                i = close + len(self.args_end)
                continue
            if known:
                scan.calls.append(ScannedCall(match["name"], json.loads(text[i:end]), True))
            i = end
        return scan


def _partial(rest: str):
    try:
        return parse_prefix(rest)[0]
    except ValueError:
        return None


def deepseek_v3() -> TaggedCallsDetector:
    """DeepSeek-V3 / R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    then the arguments in a ```json fence, <｜tool▁call▁end｜>, ... <｜tool▁calls▁end｜>."""
    return TaggedCallsDetector(
        bot="<｜tool▁calls▁begin｜>", call_begin="<｜tool▁call▁begin｜>",
        args_begin="\n```json\n", args_end="<｜tool▁call▁end｜>",
        name_re=r"\s*function<｜tool▁sep｜>(?P<name>[^\n]+?)\s*",
        begin="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n",
        end="\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def kimi_k2() -> TaggedCallsDetector:
    """Kimi-K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{...}<|tool_call_end|> ... <|tool_calls_section_end|>."""
    return TaggedCallsDetector(
        bot="<|tool_calls_section_begin|>", call_begin="<|tool_call_begin|>",
        args_begin="<|tool_call_argument_begin|>", args_end="<|tool_call_end|>",
        name_re=r"\s*(?:functions\.)?(?P<name>[\w.\-]+?):\d+\s*",
        begin="<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0"
              "<|tool_call_argument_begin|>",
        end="<|tool_call_end|><|tool_calls_section_end|>")


# `[name(` opens a pythonic call list; while the text may still become one it is held.
_PY_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_PY_MAYBE = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?\Z")


class PythonicDetector:
    """Llama 3.2 / 4's pythonic calls: `[get_weather(city="Paris"), get_time()]`, keyword
    arguments with literal values (a list whose elements are not all such calls is text).
    <|python_start|> / <|python_end|> around it are dropped. Calls come out whole once the
    list closes; the text before and after it is content."""

    def structure_info(self, name: str) -> None:
        return None  # no JSON inside: auto tool_choice is not constrained

    def scan(self, text: str, final: bool, tools: Container[str]) -> Scan:
        text = text.replace("<|python_start|>", "").replace("<|python_end|>", "")
        scan, i = Scan(), 0
        while True:
            start = text.find("[", i)
            if start < 0:
                scan.normal += text[i:]
                return scan
            scan.normal += text[i:start]
            if not final and _PY_MAYBE.match(text, start):
                return scan  # may still become `[name(`
            close = _closing_bracket(text, start) if _PY_START.match(text, start) else None
            if close is None and not final and _PY_START.match(text, start):
                return scan  # the list is still being written
            calls = None if close is None else _python_calls(text[start:close], tools)
            if calls is None:
                scan.normal += "["
                i = start + 1
                continue
            scan.calls.extend(calls)
            i = close


def _closing_bracket(text: str, start: int) -> int | None:
    """Index past the `]` matching text[start] (strings skipped), or None if not there."""
    depth, quote, i = 0, None, start
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "[({":
            depth += 1
        elif c in "])}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _python_calls(block: str, tools: Container[str]) -> list[ScannedCall] | None:
    try:
        tree = ast.parse(block, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not all(
            isinstance(e, ast.Call) and isinstance(e.func, ast.Name) for e in tree.elts):
        return None
    calls = []
    for call in tree.elts:
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
            json.dumps(args)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None  # not JSON-like literals: not a call list
        if call.func.id in tools:
            calls.append(ScannedCall(call.func.id, args, True))
    return calls
