"""SGLang's native /generate: one prompt or a batch (native_batch.py fans it out), JSON or SSE
(every chunk the cumulative text and ids, as SGLang), with SGLang's meta_info."""
from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvstrata.entrypoints.api import pd_fields
from kvstrata.entrypoints.api import serving_openai as so
from kvstrata.entrypoints.api.errors import ApiError, from_sampling_error
from kvstrata.entrypoints.api.native_batch import batch_items
from kvstrata.entrypoints.api.native_protocol import native_sampling_dict
from kvstrata.entrypoints.api.serving_handlers import collect, first_or_error, sse_stream
from kvstrata.entrypoints.api.meta_info import Acc, meta_info
from kvstrata.entrypoints.api.structured_output import check_grammar_allowed
from kvstrata.frontend import ipc
from kvstrata.protocol import SamplingParams


async def generate_response(state, request: Request, body):
    tm = state.tm
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", "text")
    batch = batch_items(body, state.server_args)
    if batch is not None:
        tasks = [asyncio.create_task(generate_response(state, request, one))
                 for one in batch]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one prompt failed (or the client left): abort the others too
            for task in tasks:
                task.cancel()
    ids = tm.encode_prompt(body.text) if body.text is not None else list(body.input_ids)
    prompt_param = "text" if body.text is not None else "input_ids"
    so.check_token_ids(tm, ids, prompt_param)
    so.check_lengths(len(ids), None, state.context_len, prompt_param, "max_new_tokens")
    sp = _native_sampling_params(body)
    so.check_logit_bias(tm, sp, "sampling_params.logit_bias")
    grammar_param = None if sp.grammar_field is None else f"sampling_params.{sp.grammar_field}"
    if grammar_param is not None:
        check_grammar_allowed(state.server_args, sp, grammar_param)
    so.check_token_ids(tm, sp.token_ids_logprob, "token_ids_logprob")
    so.check_lengths(len(ids), sp.max_new_tokens, state.context_len, prompt_param,
                     "sampling_params.max_new_tokens")
    want_lp = bool(body.return_logprob)
    input_lp = want_lp and body.logprob_start_len is not None and body.logprob_start_len >= 0
    tt = so.TokenText(tm.tokenizer) if body.return_text_in_logprobs else None
    rid = body.rid or tm.new_rid()
    choice = so.Choice(0, ipc.GenerateReq(
        rid=rid, prompt_ids=ids, sampling_params=sp, return_prompt_logprobs=input_lp,
        priority=body.priority, cache_salt=so.cache_salt(body)), grammar_param=grammar_param)
    pd_fields.attach(state.server_args, choice.req,
                     {name: getattr(body, name) for name in pd_fields.FIELDS})
    start = time.perf_counter()
    gen = so.merged_outputs(tm, [choice], log_metrics=body.log_metrics)
    acc = Acc(choice)
    if not body.stream:
        await collect(request, gen, {rid: acc})
        return {"text": acc.text, "output_ids": acc.token_ids,
                "meta_info": meta_info(acc.last, acc, rid, start, want_lp, input_lp, tt)}
    first = await first_or_error(gen)

    def render(choice, out):
        acc.add(out)
        # SGLang streams the cumulative text and ids so far in every chunk.
        return so.encode_sse({"text": acc.text, "output_ids": acc.token_ids,
                              "meta_info": meta_info(out, acc, rid, start, want_lp, input_lp,
                                                 tt)})

    stream = sse_stream(gen, first, render)
    return StreamingResponse(stream, media_type="text/event-stream")


def _native_sampling_params(body) -> SamplingParams:
    sp_dict = native_sampling_dict(body.sampling_params or {})
    if body.return_logprob:
        sp_dict["logprobs"] = body.top_logprobs_num or 0
    if body.token_ids_logprob:
        if not body.return_logprob:
            raise ApiError(400, "token_ids_logprob needs return_logprob=true",
                           "token_ids_logprob")
        if isinstance(body.token_ids_logprob[0], list):
            raise ApiError(400, "token_ids_logprob is a list per prompt but the prompt is "
                           "not a batch", "token_ids_logprob")
        sp_dict["token_ids_logprob"] = list(body.token_ids_logprob)
    try:
        return SamplingParams.from_dict(sp_dict)
    except ValueError as e:
        err = from_sampling_error(e, openai_names=False)
        if err.param == "logprobs" and body.return_logprob:  # the client sent it by this name
            err.param = "top_logprobs_num"
            err.message = err.message.replace("logprobs", "top_logprobs_num", 1)
        elif err.param not in ("sampling_params", "token_ids_logprob"):  # top-level fields
            err.param = f"sampling_params.{err.param}"
        raise err from None
