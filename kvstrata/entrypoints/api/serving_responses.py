"""/v1/responses' answer: the Responses request as a chat request through the chat route
(responses_api.py), collected into one response object or streamed as the Responses
events (responses_stream.py)."""
from __future__ import annotations

from fastapi.responses import StreamingResponse

from kvstrata.entrypoints.api import pd_fields
from kvstrata.entrypoints.api import serving_handlers as sh
from kvstrata.entrypoints.api import serving_openai as so
from kvstrata.entrypoints.api.errors import ApiError
from kvstrata.entrypoints.api.meta_info import Acc
from kvstrata.entrypoints.api.responses_api import (ResponsesRequest, chat_request, now,
                                                    output_items, renamed, response_object,
                                                    responses_param)
from kvstrata.entrypoints.api.responses_stream import ResponsesEvents
from kvstrata.entrypoints.api.serving_chat import chat_deltas, chat_message, choice_streams


async def responses_response(state, request, body: ResponsesRequest):
    """A Responses answer: one response object, or (stream) its events."""
    chat = chat_request(body)
    try:
        choices = so.chat_choices(state.tm, chat, state.context_len)
        pd_fields.check_choices(state.server_args, chat, choices)
    except ApiError as e:
        raise renamed(e) from None
    for choice in choices:  # a grammar's errors name this request's field (text.format)
        choice.grammar_param = responses_param(choice.grammar_param)
    created, rid, model = now(), f"resp_{choices[0].req.rid}", state.model_names[0]
    c = choices[0]
    acc = Acc(c)
    gen = so.merged_outputs(state.tm, choices)
    if not body.stream:
        await sh.collect(request, gen, {c.req.rid: acc})
        message, _ = chat_message(acc)
        return response_object(body, rid, model, created, output_items(message),
                               acc.last.finish_type, acc.last)

    first = await sh.first_or_error(gen)
    events = ResponsesEvents(response_object(body, rid, model, created, [], None, None))
    thinking, tools = choice_streams(c)

    def render(choice, out):
        acc.add(out)
        data = b"".join(b"".join(events.feed(d)) for d in chat_deltas(thinking, tools, out))
        if out.finished:  # (only "length" shows in a response: status incomplete)
            data += b"".join(events.finish(body, rid, model, created, out.finish_type, out))
        return data or None

    def error(err) -> bytes:
        return events.event("error", code=err.code, message=err.message, param=err.param)

    # (the Responses API's stream ends with its last event, no [DONE])
    stream = sh.sse_stream(gen, first, render, prelude=events.start(), done=b"", error=error)
    return StreamingResponse(stream, media_type="text/event-stream")
