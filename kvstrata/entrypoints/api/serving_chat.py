"""/v1/chat/completions' response from merged engine outputs: one JSON object, or an SSE
stream ending in [DONE]. Under --reasoning-parser an answer's thinking section goes to
reasoning_content (entrypoints/reasoning.py); a request with tools has the rest read into
tool_calls (tool_choice.py): whole at the end, or as deltas while streaming (a role chunk,
reasoning and content deltas, then per call a chunk with its id and name and chunks with
its arguments).
"""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvstrata.entrypoints.api import serving_handlers as sh
from kvstrata.entrypoints.api import serving_openai as so
from kvstrata.entrypoints.api.errors import ApiError
from kvstrata.entrypoints.api.meta_info import Acc, meta_info
from kvstrata.entrypoints.reasoning import ReasoningStream
from kvstrata.frontend import ipc


def _finish(finish: str | None, matched, has_calls: bool):
    """SGLang: a stop with tool calls is finish_reason tool_calls (and no matched stop);
    "length" and the others stay."""
    if has_calls and finish == "stop":
        return "tool_calls", None
    return finish, matched


def chat_message(a: Acc) -> tuple[dict, bool]:
    c, text, message = a.choice, a.text, {"role": "assistant"}
    reasoning = None
    if c.reasoning is not None:
        reasoning, text = c.reasoning.split(text)
    calls = None
    if c.tools is not None:
        text, calls = c.tools.read(text, c.tool_constrained)
    message["content"] = text
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)


async def chat_response(state, request: Request, body, choices: list[so.Choice]):
    model, created, rid = state.model_names[0], so.now(), f"chatcmpl-{choices[0].req.rid}"
    tt = so.TokenText(state.tm.tokenizer)
    if body.stream and (body.return_prompt_token_ids or body.return_meta_info):
        name = "return_prompt_token_ids" if body.return_prompt_token_ids else "return_meta_info"
        raise ApiError(400, f"{name} is not supported with streaming. Please set "
                       f"stream=false when using {name}=true.", name)  # SGLang's message
    start = time.perf_counter()
    gen = so.merged_outputs(state.tm, choices)
    accs = {c.req.rid: Acc(c) for c in choices}
    if not body.stream:
        await sh.collect(request, gen, accs)
        out_choices = []
        for a in sorted(accs.values(), key=lambda a: a.choice.index):
            out = a.last
            sglang = {}  # SGLang's TITO fields (token in, token out: RL trainers)
            if body.return_prompt_token_ids:
                sglang["prompt_token_ids"] = a.choice.req.prompt_ids
            if body.return_meta_info:
                sglang["meta_info"] = meta_info(out, a, a.choice.req.rid, start,
                                                bool(body.logprobs), False, None)
            logprobs = None
            if body.logprobs:
                merged = ipc.TextOutput(rid="", text="", new_token_ids=a.token_ids,
                                        finished=True, new_logprobs=a.logprobs,
                                        new_top_logprobs=a.top_logprobs or None)
                logprobs = {"content": so.chat_logprobs(tt, merged)}
            message, has_calls = chat_message(a)
            finish, matched = _finish(out.finish_type, out.matched_stop, has_calls)
            out_choices.append({"index": a.choice.index, "logprobs": logprobs,
                                "message": message, "finish_reason": finish,
                                "matched_stop": matched,
                                **sh.token_ids(body, a.token_ids), **sglang})
        response = {"id": rid, "object": "chat.completion", "created": created,
                    "model": model, "choices": out_choices,
                    "usage": sh.total_usage(list(accs.values()), body.n)}
        if body.return_token_ids:
            response["prompt_token_ids"] = choices[0].req.prompt_ids
        return response

    include_usage, continuous = sh.stream_usage(body)
    first = await sh.first_or_error(gen)
    streams = {c.req.rid: choice_streams(c) for c in choices}

    def chunk(choice, delta: dict, finish=None, logprobs=None, matched=None,
              ids: list[int] | None = None) -> bytes:
        obj = {"id": rid, "object": "chat.completion.chunk", "created": created,
               "model": model, "choices": [{"index": choice.index, "delta": delta,
                                            "logprobs": logprobs, "finish_reason": finish,
                                            **sh.token_ids(body, ids)}]}
        if ids is None and body.return_token_ids:  # the role chunk: the prompt's ids
            obj["prompt_token_ids"] = choice.req.prompt_ids
        if finish is not None:
            obj["choices"][0]["matched_stop"] = matched
        if include_usage:
            obj["usage"] = sh.running_usage(accs[choice.req.rid]) if continuous else None
        return so.encode_sse(obj)

    def render(choice, out):
        accs[choice.req.rid].add(out)
        lp = {"content": so.chat_logprobs(tt, out)} if body.logprobs else None
        thinking, tools = streams[choice.req.rid]
        deltas = chat_deltas(thinking, tools, out)
        finish, matched = _finish(so.finish_reason(out), out.matched_stop,
                                  tools is not None and tools.calls_sent > 0)
        if not deltas and (out.finished or (lp and lp["content"]) or (
                body.return_token_ids and out.new_token_ids)):
            deltas = [{}]
        if not deltas:
            return None
        # The output's logprobs and ids ride on its first chunk, its finish on its last.
        last = len(deltas) - 1
        return b"".join(chunk(choice, d, finish if k == last else None,
                              lp if k == 0 else None, matched,
                              out.new_token_ids if k == 0 else [])
                        for k, d in enumerate(deltas))

    def tail():
        if include_usage:
            yield so.encode_sse({"id": rid, "object": "chat.completion.chunk",
                                 "created": created, "model": model, "choices": [],
                                 "usage": sh.total_usage(list(accs.values()), body.n)})

    prelude = [chunk(c, {"role": "assistant", "content": ""}) for c in choices]
    stream = sh.sse_stream(gen, first, render, prelude=prelude, tail=tail)
    return StreamingResponse(stream, media_type="text/event-stream")


def choice_streams(c: so.Choice) -> tuple:
    """(reasoning stream, tool-call stream) of one streamed choice (either may be None)."""
    return (ReasoningStream(c.reasoning) if c.reasoning else None,
            c.tools.stream(c.tool_constrained) if c.tools else None)


def chat_deltas(thinking, tools, out: ipc.TextOutput) -> list[dict]:
    """One output's deltas: reasoning and content as they settle, each tool_calls item in a
    chunk of its own; at the finish, what the parsers held back."""
    parts = [thinking.feed(out.text)] if thinking else [("", out.text)]
    if out.finished and thinking:
        parts.append(thinking.finish())
    deltas = []
    for reasoning, text in parts:
        if reasoning:
            deltas.append({"reasoning_content": reasoning})
        if tools is None:
            if text:
                deltas.append({"content": text})
        else:
            deltas.extend(_tool_items(tools.feed(text)))
    if out.finished and tools is not None:
        deltas.extend(_tool_items(tools.finish()))
    return deltas


def _tool_items(part) -> list[dict]:
    items = [{"content": part.content}] if part.content else []
    return items + [{"tool_calls": [item]} for item in part.tool_calls]
