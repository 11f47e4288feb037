"""SGLang's parser routes: /parse_function_call and /separate_reasoning read a text the
client already has (a model's answer generated elsewhere) with any of the server's tool-call
or reasoning formats, whatever the server's own --tool-call-parser / --reasoning-parser."""
from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Request
from pydantic import Field

from kvstrata.config.server_args import REASONING_PARSERS, TOOL_CALL_PARSERS
from kvstrata.entrypoints.api.openai_protocol import ToolDef
from kvstrata.entrypoints.api.protocol_base import StrictModel
from kvstrata.entrypoints.api.request_parsing import body_spec, parse_body
from kvstrata.entrypoints.reasoning import FORMATS, split
from kvstrata.entrypoints.tool_calls import make_detector, read_calls
from kvstrata.entrypoints.tool_calls.partial_json import dumps


class ParseFunctionCallRequest(StrictModel):
    text: str
    tool_call_parser: Literal[TOOL_CALL_PARSERS]  # type: ignore[valid-type]
    tools: list[ToolDef] = Field(default_factory=list)


class SeparateReasoningRequest(StrictModel):
    text: str
    reasoning_parser: Literal[REASONING_PARSERS]  # type: ignore[valid-type]


def add_parser_routes(app: FastAPI) -> list[type]:
    """Registers the routes; returns their request models (for /openapi.json)."""

    @app.post("/parse_function_call", openapi_extra=body_spec(ParseFunctionCallRequest))
    async def parse_function_call(request: Request):
        body = await parse_body(request, ParseFunctionCallRequest)
        tools = {t.function.name: t.function.parameters or {} for t in body.tools}
        content, calls = read_calls(make_detector(body.tool_call_parser), body.text, tools)
        index = {name: i for i, name in enumerate(tools)}
        return {"normal_text": content or "",
                "calls": [{"tool_index": index[c.name], "name": c.name,
                           "parameters": dumps(c.args)} for c in calls]}

    @app.post("/separate_reasoning", openapi_extra=body_spec(SeparateReasoningRequest))
    async def separate_reasoning(request: Request):
        body = await parse_body(request, SeparateReasoningRequest)
        reasoning, text = split(FORMATS[body.reasoning_parser], body.text, False, final=True)
        return {"text": text, "reasoning_text": reasoning}

    return [ParseFunctionCallRequest, SeparateReasoningRequest]
