"""/v1/responses (OpenAI's Responses API, which SGLang and vLLM serve too): a request becomes
a chat request (its input items as messages, its function tools and text.format as chat
fields), runs through the chat route's machinery -- template, grammar, tool-call and
reasoning parsers -- and its answer comes back as output items (reasoning, message,
function_call). Nothing is stored: `previous_response_id` is refused; a conversation is
sent whole, as its items. serving_responses.py answers the route."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import Field, ValidationError

from kvstrata.entrypoints.api.errors import ApiError, bad_request
from kvstrata.entrypoints.api.openai_protocol import ChatCompletionRequest, usage_dict
from kvstrata.entrypoints.api.protocol_base import RequestModel, StrictModel


class ResponsesTextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponsesText(StrictModel):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ResponsesReasoning(StrictModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    # accepted; nothing is kept, and the response says so (store: false), as vLLM without its
    # store; previous_response_id is refused
    store: bool | None = None
    metadata: dict[str, str] | None = None  # echoed back
    user: str | None = None
    seed: int | None = None  # vLLM's extra
    # Known fields accepted only when off.
    previous_response_id: str | None = None
    background: bool = False
    include: list[str] | None = None
    truncation: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    service_tier: str | None = None
    # OpenAI's hints, no-ops here: the prefix cache finds shared prefixes without a key;
    # there is no abuse monitoring to identify users to (as `user`)
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    NOT_IMPLEMENTED = frozenset({
        "previous_response_id", "background", "include", "truncation", "conversation",
        "prompt", "top_logprobs", "max_tool_calls", "service_tier"})
    ALSO_OFF = {"include": ([],), "truncation": ("disabled",), "service_tier": ("auto",
                                                                             "default")}


# ---- request -> chat request ------------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}.{j}: {kind} is not supported: this server serves a "
                              "text-only model", f"{where}.{j}")
        else:
            raise bad_request(f"{where}.{j}: not a text part ({kind!r})", f"{where}.{j}")
    return "".join(texts)


def _messages(body: ResponsesRequest) -> list[dict]:
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    # Nothing is stored (no previous_response_id): a tool's output answers a call in this
    # input, or OpenAI's 400; a chat template would otherwise render a reply to nothing.
    calls = {item.get("call_id") for item in body.input
             if item.get("type") == "function_call" and isinstance(item.get("call_id"), str)}
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or "
                                  f"assistant, got {role!r}", f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"),
                                                               f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # one assistant turn, several calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise bad_request(f"No tool call found for function call output with call_id "
                                  f"{call_id}.", "input")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str)
                             else json.dumps(output)})
        elif kind == "reasoning":
            continue  # the model's own earlier thinking: templates drop it anyway
        else:
            raise bad_request(f"not implemented yet: {where}.type {kind!r}", f"{where}.type")
    return messages


def _tools(body: ResponsesRequest) -> list[dict] | None:
    if body.tools is None:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise bad_request(f"not implemented yet: tools.{i}.type {tool.get('type')!r} "
                              "(only function tools)", f"tools.{i}.type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
              if tool.get(k) is not None}
        tools.append({"type": "function", "function": fn})
    return tools


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request is (its errors name the Responses fields
    where they differ)."""
    for name, value in (("reasoning.summary", body.reasoning and body.reasoning.summary),
                        ("reasoning.generate_summary",
                         body.reasoning and body.reasoning.generate_summary),
                        ("text.verbosity", body.text and body.text.verbosity)):
        if value is not None:  # no summariser, no verbosity control: refused, not ignored
            raise bad_request(f"not implemented yet: {name} (the reasoning comes back whole, "
                              "as reasoning_text)" if name.startswith("reasoning") else
                              f"not implemented yet: {name}", name)
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body),
                            "max_completion_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p,
                            "seed": body.seed, "user": body.user,
                            "parallel_tool_calls": body.parallel_tool_calls,
                            "tools": _tools(body)}
    choice = body.tool_choice
    if isinstance(choice, dict):  # {"type": "function", "name": ...}
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat["tool_choice"] = choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format.schema is required for json_schema",
                              "text.format.schema")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    chat = {k: v for k, v in chat.items() if v is not None}
    try:
        return ChatCompletionRequest.model_validate(chat, strict=False)
    except ValidationError as e:  # a message or tool the chat model refuses
        err = e.errors()[0]
        param = responses_param(".".join(str(p) for p in err["loc"][:1]))
        raise bad_request(f"{param}: {err['msg']}", param) from None


# The chat fields' names in errors -> this request's.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    head, _, rest = param.partition(".")
    return _PARAMS.get(head, head) + (f".{rest}" if rest and head != "messages" else "")


def renamed(err: ApiError) -> ApiError:
    """A chat-route error, naming this request's field."""
    param = responses_param(err.param)
    message = err.message
    if err.param and param != err.param and message.startswith(err.param):
        message = param + message[len(err.param):]
    return ApiError(err.status, message, param, err.type, err.code)


# ---- answer -> response ------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict) -> list[dict]:
    """A chat answer's message (serving_chat._message) as Responses output items."""
    items = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": new_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text",
                                   "text": message["reasoning_content"]}]})
    if message.get("content"):
        items.append({"type": "message", "id": new_id("msg"), "status": "completed",
                      "role": "assistant", "content": [
                          {"type": "output_text", "text": message["content"],
                           "annotations": [], "logprobs": []}]})
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                      "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def response_object(body: ResponsesRequest, rid: str, model: str, created: int,
                    output: list[dict], finish: str | None, last) -> dict:
    incomplete = finish == "length"
    usage = usage_dict(last.prompt_tokens, last.completion_tokens, last.cached_tokens) \
        if last is not None else usage_dict(0, 0)
    fmt = body.text.format if body.text and body.text.format else None
    return {
        "id": rid, "object": "response", "created_at": created, "model": model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None, "output": output,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls
        is not False, "temperature": body.temperature, "top_p": body.top_p,
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                 else {"type": "text"}},
        "reasoning": body.reasoning.model_dump() if body.reasoning else None,
        "store": False, "user": body.user,
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": usage.get(
                      "prompt_tokens_details", {}).get("cached_tokens", 0)},
                  "output_tokens": usage["completion_tokens"],
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
    }


def now() -> int:
    return int(time.time())
