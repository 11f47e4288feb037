"""Tool-call formats that write arguments as tagged text, one parameter at a time (Qwen3-Coder,
GLM-4.5 / 4.6 / 4.7). A value is text; the tool's JSON schema says what it is (a string
stays text, an integer is parsed, an object is JSON). A streamed call grows by whole
parameters: a value counts once its closing tag is there."""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from kvstrata.entrypoints.tool_calls.core import Scan, ScannedCall, held_prefix

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def _types(tools, name: str, key: str) -> set[str]:
    """The JSON types the tool's schema gives parameter `key` (empty if unknown)."""
    schema = tools.get(name) if isinstance(tools, dict) else None
    prop = ((schema or {}).get("properties") or {}).get(key)
    if not isinstance(prop, dict):
        return set()
    kinds = prop.get("type")
    out = set(kinds) if isinstance(kinds, list) else {kinds} if isinstance(kinds, str) else set()
    for sub in prop.get("anyOf", []) + prop.get("oneOf", []):
        if isinstance(sub, dict) and isinstance(sub.get("type"), str):
            out.add(sub["type"])
    if not out and prop.get("enum") and all(isinstance(v, str) for v in prop["enum"]):
        out = {"string"}
    return {k.lower() for k in out if isinstance(k, str)}


def convert(value: str, types: set[str]) -> Any:
    """A parameter's text as its schema's type: strings stay text (so do values that do not
    parse as the type); "null" is null for non-string types."""
    if types & set(_STRING_TYPES) and not types - set(_STRING_TYPES) - {"null"}:
        return value
    if value.strip().lower() == "null":
        return None
    text = value.strip()
    if types & {"integer", "int"} and re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    if types & {"number", "float"}:
        try:
            number = float(text)
        except ValueError:
            return value
        is_int = re.fullmatch(r"[-+]?\d+", text) and number.is_integer()
        return int(text) if is_int else number
    if types & {"boolean", "bool"} and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if not types or types & {"object", "array", "dict", "list"}:
        for parse in (json.loads, ast.literal_eval):
            try:
                parsed = parse(text)
                json.dumps(parsed)
                return parsed
            except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
                continue
    return value


class _XmlDetector:
    """Shared scan: a call section opened by `bot` (or `alt_bot`), one call per block."""
    bot = "<tool_call>"
    eot = "</tool_call>"
    alt_bot: str | None = None

    def structure_info(self, name: str) -> None:
        return None  # tagged text, not JSON: auto tool_choice is not constrained

    def scan(self, text: str, final: bool, tools) -> Scan:
        starts = [p for p in (text.find(self.bot), text.find(self.alt_bot)
                              if self.alt_bot else -1) if p >= 0]
        if not starts:
            keep = 0 if final else max(held_prefix(text, m) for m in
                                       (self.bot, self.alt_bot or self.bot))
            return Scan(normal=text[:len(text) - keep])
        pos = min(starts)
        scan, i = Scan(normal=text[:pos]), pos
        while i < len(text):
            call, i = self._call(text, i, final, tools)
            if call is not None and call.name in tools:
                scan.calls.append(call)
            if i is None:
                break
        return scan

    def _call(self, text: str, i: int, final: bool, tools):
        raise NotImplementedError


_PARAM = re.compile(r"<parameter=([^>\n]+)>")


class Qwen3CoderDetector(_XmlDetector):
    """Qwen3-Coder: <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>
    ...</function>\\n</tool_call> (one newline either side of a value is not part of it)."""
    alt_bot = "<function="

    def _call(self, text, i, final, tools):
        start = text.find("<function=", i)
        if start < 0:
            return None, None
        name_end = text.find(">", start)
        if name_end < 0:
            return None, None
        name = text[start + len("<function="):name_end].strip()
        end = text.find("</function>", name_end)
        body = text[name_end + 1:end if end >= 0 else len(text)]
        args, j = {}, 0
        while (m := _PARAM.search(body, j)) is not None:
            close = [p for p in (body.find("</parameter>", m.end()),
                                 body.find("<parameter=", m.end())) if p >= 0]
            if not close and end < 0:
                break  # the value is still being written
            stop = min(close) if close else len(body)
            value = body[m.end():stop]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = m.group(1).strip()
            args[key] = convert(value, _types(tools, name, key))
            j = stop
        if end < 0:
            return (None if final else ScannedCall(name, args)), None
        after = end + len("</function>")
        close = text.find(self.eot, after)
        nxt = text.find("<function=", after)
        if close >= 0 and (nxt < 0 or close < nxt):
            after = close + len(self.eot)
        return ScannedCall(name, args, True), after


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45Detector(_XmlDetector):
    """GLM-4.5 / 4.6 / 4.7: <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE
    </arg_value>...</tool_call> (4.7 writes no newline after the name)."""

    def _call(self, text, i, final, tools):
        start = text.find(self.bot, i)
        if start < 0:
            return None, None
        head = start + len(self.bot)
        end = text.find(self.eot, head)
        body = text[head:end if end >= 0 else len(text)]
        cut = [p for p in (body.find("\n", len(body) - len(body.lstrip())),
                           body.find("<arg_key>")) if p >= 0]
        if not cut and end < 0:
            return None, None  # the name is still being written
        name = body[:min(cut) if cut else len(body)].strip()
        args = {m.group(1).strip(): convert(m.group(2), _types(tools, name, m.group(1).strip()))
                for m in _ARG.finditer(body)}
        if end < 0:
            return (None if final else ScannedCall(name, args)), None
        return ScannedCall(name, args, True), end + len(self.eot)
