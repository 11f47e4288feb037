"""A chat request's `tools` / `tool_choice` -> what the chat template shows, the constraint on
the answer, and how the answer is read back into tool_calls (SGLang's rules; docs/api.md
"Tool calling").

- tool_choice defaults to "auto" with tools, "none" without. "none": the tools are not shown
  and nothing is read. A named tool: only it is shown.
- "required" / a named tool: the answer is constrained (structured output) to a JSON array
  of {"name": <a tool>, "parameters": <its schema>} objects -- one item for a named tool or
  with parallel_tool_calls false -- and read back whatever --tool-call-parser says (the
  format is ours, not the model's).
- "auto": --tool-call-parser reads the model's own format; when a tool is `strict`, the
  calls are constrained by a structural tag in that format (free text outside them).
- finish_reason "stop" becomes "tool_calls" when the answer holds a call ("length" stays).
"""
from __future__ import annotations

import copy
import json
import logging
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvstrata.entrypoints.api.errors import bad_request
from kvstrata.entrypoints.tool_calls import (ToolCallStream, json_array_detector,
                                             make_detector, read_calls)
from kvstrata.entrypoints.tool_calls.partial_json import dumps

logger = logging.getLogger(__name__)
_ALNUM = string.ascii_letters + string.digits


@dataclass
class ToolPlan:
    names: dict[str, dict]  # the offered tools' names -> their parameters' schemas
    template_tools: list[dict] | None  # the `tools` the chat template gets
    constraint: dict[str, str] = field(default_factory=dict)  # json_schema | structural_tag
    detector: Any = None  # reads the answer; None: it comes back as content
    array_detector: Any = None  # reads the constrained JSON array (required / named)
    kimi_ids: int | None = None  # Kimi-K2 ids count the history's calls
    mistral_ids: bool = False  # Mistral's templates accept only 9-character ids

    def reader(self, constrained: bool):
        """The detector for an answer, knowing whether the constraint was applied."""
        return self.array_detector if constrained and self.array_detector else self.detector

    def call_id(self, index: int, name: str) -> str:
        if self.kimi_ids is not None:
            return f"functions.{name}:{self.kimi_ids + index}"
        if self.mistral_ids:  # as vLLM: the template refuses other ids sent back to it
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return "call_" + uuid.uuid4().hex[:24]

    def stream(self, constrained: bool) -> ToolCallStream | None:
        reader = self.reader(constrained)
        if reader is None:
            return None
        return ToolCallStream(lambda text, final: reader.scan(text, final, self.names),
                              self.call_id)

    def read(self, text: str, constrained: bool) -> tuple[str | None, list[dict] | None]:
        """(content, tool_calls) of a finished answer; no calls: the text, None."""
        reader = self.reader(constrained)
        if reader is None:
            return text, None
        content, found = read_calls(reader, text, self.names)
        calls = [{"id": self.call_id(i, c.name), "index": i, "type": "function",
                  "function": {"name": c.name, "arguments": dumps(c.args)}}
                 for i, c in enumerate(found)]
        return content, calls or None


def plan_tools(server_args, body) -> ToolPlan | None:
    """None when the request offers no tools or tool_choice is "none" (the template gets no
    tools, the answer is text)."""
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    named = None if isinstance(choice, str) else choice.function.name
    if choice == "required" and not tools:
        raise bad_request("Tools cannot be empty if tool choice is set to required.",
                          "tool_choice")
    if named is not None and not tools:
        raise bad_request("Tools cannot be empty if tool choice is set to a specific tool.",
                          "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"tools: function name {dup!r} is given twice", "tools")
    if named is not None and named not in names:
        raise bad_request(f"Tool '{named}' not found in tools list.", "tool_choice")
    if choice == "none" or not tools:
        return None
    shown = [t for t in tools if named is None or t.function.name == named]
    parser = getattr(server_args, "tool_call_parser", None)
    plan = ToolPlan(names={t.function.name: t.function.parameters or {} for t in tools},
                    template_tools=[t.model_dump(exclude_none=True) for t in shown],
                    detector=make_detector(parser) if parser else None)
    if parser == "kimi_k2":
        plan.kimi_ids = sum(len(m.tool_calls or []) for m in body.messages)
    plan.mistral_ids = parser == "mistral"
    if choice == "required" or named is not None:
        one = named is not None or body.parallel_tool_calls is False
        plan.constraint = {"json_schema": json.dumps(array_schema(shown, one))}
        plan.array_detector = json_array_detector()
    elif any(t.function.strict for t in tools) and plan.detector is not None:
        tag = structural_tag(plan.detector, tools)
        if tag is not None:
            plan.constraint = {"structural_tag": json.dumps(tag)}
    return plan


def _parameters(tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def array_schema(tools: list, one: bool) -> dict:
    """The JSON array of calls tool_choice required / named constrains to. Each tool's
    `$defs` move to the root, where its `#/$defs/...` references now point, and so do
    llguidance's options ("x-guidance") if a tool gives them."""
    defs: dict[str, Any] = {}
    items, options = [], None
    for tool in tools:
        params = copy.deepcopy(_parameters(tool))
        # llguidance's options (whitespace, ...) apply to a whole grammar: a tool's move up
        options = params.pop("x-guidance", None) or options
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise bad_request(f"Tool definition '{key}' has multiple schemas, which is "
                                  "not supported.", "tools")
            defs[key] = value
        items.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
            "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if one:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    if options:
        schema["x-guidance"] = options
    return schema


def structural_tag(detector, tools: list) -> dict | None:
    """SGLang's structural tag for tool_choice auto with strict tools: free text, and each
    call in the model's format with a strict tool's arguments held to its schema."""
    infos = [detector.structure_info(t.function.name) for t in tools]
    if any(info is None for info in infos):
        return None  # a format without JSON arguments (pythonic): not constrained
    return {"type": "structural_tag",
            "structures": [{"begin": info.begin, "end": info.end,
                            "schema": _parameters(t) if t.function.strict else {}}
                           for t, info in zip(tools, infos)],
            "triggers": sorted({info.trigger for info in infos})}


def template_tool_calls(i: int, calls: list) -> list[dict]:
    """An assistant message's tool_calls for the chat template: arguments as objects (HF
    templates write them with tojson)."""
    out = []
    for j, call in enumerate(calls):
        args = call.function.arguments
        if isinstance(args, str):
            param = f"messages.{i}.tool_calls.{j}.function.arguments"
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                raise bad_request(f"{param} must be valid JSON", param) from None
            if not isinstance(args, dict):
                raise bad_request(f"{param} must be a JSON object", param)
        item = {"type": "function", "function": {"name": call.function.name,
                                                 "arguments": args}}
        if call.id is not None:
            item["id"] = call.id
        out.append(item)
    return out
