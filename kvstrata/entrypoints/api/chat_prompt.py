"""Chat messages -> prompt token ids: message checks, the chat template (with the client's
chat_template_kwargs and the request's tools), SGLang's continue_final_message, and
pre-tokenised input_ids."""
from __future__ import annotations

import inspect

import jinja2

from kvstrata.entrypoints.api.errors import bad_request
from kvstrata.entrypoints.api.openai_protocol import (MEDIA_PARTS, ChatCompletionRequest,
                                                  TextPart)
from kvstrata.entrypoints.api.tool_choice import template_tool_calls
from kvstrata.frontend.tokenizer_loader import TokenizerSkipped


# transformers' apply_chat_template parameters: refused as template variables whichever
# tokenizer renders (the PlainTokenizer's own call takes fewer).
TEMPLATE_CALL_PARAMETERS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "kwargs"})


def _check_message(i: int, m) -> None:
    param = f"messages.{i}.content"
    name = m.first_unimplemented({n: getattr(m, n) for n in sorted(m.NOT_IMPLEMENTED)})
    if name is not None:
        raise bad_request(f"not implemented yet: messages.{i}.{name}", f"messages.{i}.{name}")
    if m.content is None:
        if m.role == "assistant" and m.tool_calls:
            return  # OpenAI: a turn of only tool calls has no content
        raise bad_request(f"{param} is required (only an assistant message with tool_calls "
                          f"may omit it)", param)
    if isinstance(m.content, str):
        return
    for j, part in enumerate(m.content):
        if isinstance(part, TextPart):
            continue
        where = f"{param}.{j}"
        if part.type in MEDIA_PARTS:
            raise bad_request(f"{where}: {MEDIA_PARTS[part.type]} input is not supported: "
                              "this server serves a text-only model", where)
        raise bad_request(f"not implemented yet: {part.type} content parts ({where})", where)


def _template_messages(body: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(body.messages):
        _check_message(i, m)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        if m.tool_calls:
            msg["tool_calls"] = template_tool_calls(i, m.tool_calls)
        out.append(msg)
    return out


def _template_kwargs(tm, body: ChatCompletionRequest) -> dict:
    """chat_template_kwargs become template variables (e.g. enable_thinking); names of
    apply_chat_template's own parameters would change how it runs, so they are refused."""
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = TEMPLATE_CALL_PARAMETERS | set(
        inspect.signature(tm.tokenizer.apply_chat_template).parameters)
    reserved |= {"messages", "conversation", "add_generation_prompt", "tokenize"}
    for key in kwargs:
        if key in reserved or not key.isidentifier():
            param = f"chat_template_kwargs.{key}"
            raise bad_request(f"{param} cannot be set through chat_template_kwargs", param)
    if body.reasoning_effort is not None:  # (chat_template_kwargs' own value wins)
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


def _render(tm, messages: list[dict], kwargs: dict, tools: list[dict] | None) -> list[int]:
    """The template with the tools as HF documents them ({"type": "function", "function":
    {...}}); a template that fails on those gets the bare function objects (SGLang's
    fallback: some templates read tool.name)."""
    if tools is None:
        return tm.apply_chat_template(messages, **kwargs)
    try:
        return tm.apply_chat_template(messages, tools=tools, **kwargs)
    except (jinja2.TemplateError, TypeError, KeyError):
        return tm.apply_chat_template(messages, tools=[t["function"] for t in tools], **kwargs)


def chat_prompt_ids(tm, body: ChatCompletionRequest,
                    tools: list[dict] | None = None) -> list[int]:
    messages = _template_messages(body)
    if body.input_ids is not None:  # SGLang: a pre-tokenised prompt bypasses the template
        return list(body.input_ids)
    # SGLang's continue_final_message: the last assistant message is not closed; the model
    # continues its text (the prefix is appended after the generation prompt).
    prefix = None
    if body.continue_final_message and messages[-1]["role"] == "assistant" \
            and isinstance(body.messages[-1].content, str):
        prefix = messages.pop()["content"]
    try:
        ids = _render(tm, messages, _template_kwargs(tm, body), tools)
    except TokenizerSkipped:
        raise  # --skip-tokenizer-init: its own 400 (the template is not at fault)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
        raise bad_request(f"messages: the chat template failed: {e}", "messages") from None
    if prefix:
        ids = ids + tm.encode_prompt(prefix)
    return ids
