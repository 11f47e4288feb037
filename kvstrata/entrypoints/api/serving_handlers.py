"""The OpenAI routes' responses from merged engine outputs: JSON, or SSE streams ending in
[DONE] (the SSE and collection helpers are shared with serving_chat.py and
serving_native.py, /generate).

Disconnects: a streaming response is cancelled by Starlette when the client goes away; a
non-streaming one is raced against request.is_disconnected(). Either way the output
generator is closed, which aborts the engine requests and frees their KV.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvstrata.entrypoints.api import serving_openai as so
from kvstrata.entrypoints.api.errors import ApiError, ClientDisconnected
from kvstrata.entrypoints.api.meta_info import Acc
from kvstrata.entrypoints.api.openai_protocol import error_body, usage_dict

_DONE = b"data: [DONE]\n\n"


def token_ids(body, ids: list[int] | None, prompt_ids: list[int] | None = None) -> dict:
    """vLLM's return_token_ids: a choice's output ids (in a stream, each chunk's new ones) and,
    on /v1/completions, its prompt's ids (in a stream, in its first chunk)."""
    if not body.return_token_ids:
        return {}
    out = {} if ids is None else {"token_ids": list(ids)}
    if prompt_ids is not None:
        out["prompt_token_ids"] = list(prompt_ids)
    return out


def stream_usage(body):
    """(include_usage, continuous): vLLM's rule, continuous usage needs both flags."""
    opts = body.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and opts.continuous_usage_stats


def running_usage(a: Acc) -> dict:
    """One choice's usage so far (stream_options.continuous_usage_stats, on every chunk)."""
    if a.last is None:
        return usage_dict(len(a.choice.req.prompt_ids), 0)
    return usage_dict(a.last.prompt_tokens, a.last.completion_tokens, a.last.cached_tokens)


def total_usage(accs: list[Acc], n: int) -> dict:
    firsts = [a.last for a in accs if a.choice.index % n == 0 and a.last]
    return usage_dict(sum(o.prompt_tokens for o in firsts),
                      sum(a.last.completion_tokens for a in accs if a.last),
                      sum(o.cached_tokens for o in firsts))


async def first_or_error(gen: AsyncIterator):
    """Wait for the first output, so that an error before any token (bad prompt length, dead
    engine) is still a proper HTTP status rather than an error inside a 200 stream."""
    try:
        first = await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise
    err = so.output_error(first[1], first[0])
    if err is not None:
        await gen.aclose()
        raise err
    return first


async def sse_stream(gen: AsyncIterator, first, render, *, prelude=(), tail=lambda: (),
                     done: bytes = _DONE, error=None):
    """The SSE loop the streaming endpoints share: `prelude` events, then every (choice,
    output) in arrival order through `render` (bytes, or None to skip), an error event
    (`error(ApiError)`, by default OpenAI's chat form) and `done` on the first failed output,
    else `tail()` events and `done` ([DONE]; b"" for none). The output generator is closed
    however the stream ends (a client disconnect cancels it)."""
    try:
        for data in prelude:
            yield data
        item = first
        while item is not None:
            choice, out = item
            err = so.output_error(out, choice)
            if err is not None:
                yield (error or _sse_error)(err)
                if done:
                    yield done
                return
            data = render(choice, out)
            if data is not None:
                yield data
            item = await anext(gen, None)
        for data in tail():
            yield data
        if done:
            yield done
    finally:
        await gen.aclose()


async def collect(request: Request, gen: AsyncIterator, accs: dict[str, Acc]) -> None:
    async def run():
        async for choice, out in gen:
            err = so.output_error(out, choice)
            if err is not None:
                raise err
            accs[choice.req.rid].add(out)

    task = asyncio.create_task(run())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await gen.aclose()


def _sse_error(err: ApiError) -> bytes:
    return so.encode_sse(error_body(err.message, type_=err.type, param=err.param,
                                    code=err.code))


def _completion_logprobs(tt, a: Acc, out_ids, lps, tops, echo: bool) -> dict:
    start = 0
    if echo:
        ids = a.choice.req.prompt_ids
        prompt_lps = [None] + list(a.prompt_logprobs or [None] * (len(ids) - 1))
        # The first prompt token has no logprob; the others carry top-n when asked for.
        prompt_tops = [None] + list(a.prompt_top_logprobs) if a.prompt_top_logprobs else None
        head = so.completion_logprobs(tt, ids, prompt_lps, prompt_tops, 0)
        body = so.completion_logprobs(tt, out_ids, lps, tops,
                                      len(a.choice.prompt_text or ""))
        return so.merge_logprobs(head, body)
    return so.completion_logprobs(tt, out_ids, lps, tops, start)


async def completion_response(state, request: Request, body, choices: list[so.Choice]):
    model, created, rid = state.model_names[0], so.now(), f"cmpl-{choices[0].req.rid}"
    tt = so.TokenText(state.tm.tokenizer)
    gen = so.merged_outputs(state.tm, choices)
    accs = {c.req.rid: Acc(c) for c in choices}
    want_lp = body.logprobs is not None
    if not body.stream:
        await collect(request, gen, accs)
        out_choices = []
        for a in sorted(accs.values(), key=lambda a: a.choice.index):
            text = (a.choice.prompt_text + a.text) if body.echo else a.text
            lp = _completion_logprobs(tt, a, a.token_ids, a.logprobs, a.top_logprobs or None,
                                      body.echo) if want_lp else None
            out_choices.append({"index": a.choice.index, "text": text, "logprobs": lp,
                                "finish_reason": a.last.finish_type,
                                "matched_stop": a.last.matched_stop,
                                **token_ids(body, a.token_ids, a.choice.req.prompt_ids)})
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": out_choices, "usage": total_usage(list(accs.values()), body.n)}

    include_usage, continuous = stream_usage(body)
    first = await first_or_error(gen)

    echoed: set[int] = set()
    sent_ids: set[int] = set()  # choices whose first chunk (with the prompt's ids) went out

    def render(choice, out):
        a = accs[choice.req.rid]
        a.add(out)
        text, lp = out.text, None
        echo_now = body.echo and choice.index not in echoed
        if echo_now:
            echoed.add(choice.index)
            text = choice.prompt_text + text
        if want_lp:
            lp = _completion_logprobs(tt, a, out.new_token_ids, out.new_logprobs or [],
                                      out.new_top_logprobs, echo_now)
        first_ids = choice.index not in sent_ids
        if not (text or out.finished or lp or (body.return_token_ids and (
                out.new_token_ids or first_ids))):
            return None
        sent_ids.add(choice.index)
        obj = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": choice.index, "text": text, "logprobs": lp,
                            "finish_reason": so.finish_reason(out), **token_ids(
                                body, out.new_token_ids,
                                choice.req.prompt_ids if first_ids else None)}]}
        if include_usage:
            obj["usage"] = running_usage(a) if continuous else None
        return so.encode_sse(obj)

    def tail():
        if include_usage:
            yield so.encode_sse({"id": rid, "object": "text_completion", "created": created,
                                 "model": model, "choices": [],
                                 "usage": total_usage(list(accs.values()), body.n)})

    stream = sse_stream(gen, first, render, tail=tail)
    return StreamingResponse(stream, media_type="text/event-stream")
