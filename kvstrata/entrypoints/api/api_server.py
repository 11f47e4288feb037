"""The FastAPI app: OpenAI routes, SGLang-native routes, introspection, errors.

Request bodies are parsed by request_parsing.parse_body (every failure is one OpenAI-style 400
naming the field) and declared in /openapi.json with body_spec.
"""
from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstrata import envs
from kvstrata.entrypoints.api import pd_fields
from kvstrata.entrypoints.api import serving_openai as so
from kvstrata.entrypoints.engine_factory import server_info_dict
from kvstrata.entrypoints.api.errors import ApiError, ClientDisconnected, bad_request
from kvstrata.entrypoints.api.native_protocol import AbortRequest, GenerateRequest
from kvstrata.entrypoints.api.parser_routes import add_parser_routes
from kvstrata.entrypoints.api.responses_api import ResponsesRequest
from kvstrata.entrypoints.api.serving_responses import responses_response
from kvstrata.entrypoints.api.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                                  error_body, model_list)
from kvstrata.entrypoints.api.request_parsing import add_request_schemas, body_spec, parse_body
from kvstrata.entrypoints.api.serving_chat import chat_response
from kvstrata.entrypoints.api.serving_handlers import completion_response
from kvstrata.entrypoints.api.serving_native import generate_response
from kvstrata.frontend import ipc
from kvstrata.frontend.tokenizer_loader import TokenizerSkipped
from kvstrata.frontend.tokenizer_manager import EngineDeadError
from kvstrata.version import __version__

logger = logging.getLogger(__name__)

# Upper bound on a request body; larger bodies get a 413 before they are read into memory.
MAX_BODY_BYTES = envs.KVSTRATA_MAX_REQUEST_BYTES.get()
_OPEN_PATHS = ("/health", "/metrics")

# What stands for "the client named no model": SGLang's default for the field, and what
# sglang-router (0.3) writes into a chat request that had none. Answered by the served model.
NO_MODEL_NAMED = frozenset({"default", "unknown"})


class _Guard:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects from the
    handlers): bearer-token check, and a body size limit that also counts chunked uploads."""

    def __init__(self, app, limit: int, api_key: str | None):
        self.app, self.limit, self.api_key = app, limit, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] not in _OPEN_PATHS:
            if headers.get(b"authorization", b"") != f"Bearer {self.api_key}".encode():
                return await ApiError(401, "missing or invalid API key",
                                      type_="authentication_error",
                                      code="invalid_api_key").response()(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and int(length) > self.limit:
            return await self._too_large(scope, receive, send)
        seen = 0
        started = False

        async def counting_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise ApiError(413, f"request body larger than {self.limit} bytes")
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, counting_receive, tracking_send)
        except Exception as exc:
            # Starlette re-raises an unhandled error after sending its 500, and uvicorn then
            # closes the connection: the client's next keep-alive request would be reset.
            # The response is complete (or we send one): log the error and keep the socket.
            logger.exception("error while serving %s %s", scope.get("method"), scope["path"])
            if not started:
                await ApiError(500, f"internal error: {exc!r}").response()(
                    scope, receive, send)

    async def _too_large(self, scope, receive, send):
        await JSONResponse(error_body(f"request body larger than {self.limit} bytes",
                                      code=413), status_code=413)(scope, receive, send)


def create_app(state) -> FastAPI:
    """`state` is the launcher's ServerState: tm, server_args, model names, engine info."""
    app = FastAPI(title="kvstrata", version=__version__)
    tm = state.tm
    args = state.server_args

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        # Routing's own errors (an unknown path, a wrong method) in the same OpenAI error
        # body as every other 4xx: a model name "..", which clients normalise out of the
        # path, ends up on an unknown route (found by the schema fuzz).
        err = ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")
        return JSONResponse(error_body(err.message, type_=err.type, code=err.code),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(TokenizerSkipped)
    async def _no_tokenizer(request, exc: TokenizerSkipped):
        return ApiError(400, str(exc)).response()

    @app.exception_handler(EngineDeadError)
    async def _dead(request, exc):
        # The engine is gone and this server is exiting: a router should retry elsewhere.
        return ApiError(503, str(exc), type_="service_unavailable").response()

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request, exc):
        logger.info("client disconnected before the response: %s %s", request.method,
                    request.url.path)
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _internal(request, exc):
        return ApiError(500, f"internal error: {exc!r}").response()

    def check_model(name: str | None, placeholders: frozenset = NO_MODEL_NAMED) -> None:
        if name is None or name in placeholders:
            return
        if name not in state.model_names:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                           f"{state.model_names[0]!r}", "model", code="model_not_found")

    # ---- OpenAI ------------------------------------------------------------------------
    @app.post("/v1/chat/completions", openapi_extra=body_spec(ChatCompletionRequest))
    async def chat(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        check_model(body.model)
        choices = so.chat_choices(tm, body, state.context_len)
        pd_fields.check_choices(args, body, choices)
        return await chat_response(state, request, body, choices)

    @app.post("/v1/completions", openapi_extra=body_spec(CompletionRequest))
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        check_model(body.model)
        choices = so.completion_choices(tm, body, state.context_len)
        pd_fields.check_choices(args, body, choices)
        return await completion_response(state, request, body, choices)

    @app.post("/v1/responses", openapi_extra=body_spec(ResponsesRequest))
    async def responses(request: Request):
        body = await parse_body(request, ResponsesRequest)
        check_model(body.model)
        return await responses_response(state, request, body)

    def check_alive() -> None:
        if not state.healthy():
            raise EngineDeadError(f"the server is shutting down: {tm.dead_reason}")

    @app.get("/v1/models")
    async def models():
        check_alive()
        return model_list(state.model_names[:1], state.context_len)

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve (names may hold a "/")
    async def model_card(model: str):
        check_alive()
        check_model(model, placeholders=frozenset())  # a card only for a name it serves
        return model_list([model], state.context_len)["data"][0]

    # ---- SGLang native -----------------------------------------------------------------
    @app.post("/generate", openapi_extra=body_spec(GenerateRequest))
    async def generate(request: Request):
        body = await parse_body(request, GenerateRequest)
        check_model(body.model)
        return await generate_response(state, request, body)

    @app.get("/health")
    async def health():
        return _status(200 if state.healthy() else 503)

    @app.get("/health_generate")
    async def health_generate():
        if not state.healthy():
            return _status(503)
        req = ipc.GenerateReq(rid=f"health-{tm.new_rid()}", prompt_ids=tm.health_prompt_ids(),
                              sampling_params=so.SamplingParams(max_new_tokens=1,
                                                                temperature=0.0),
                              bootstrap=pd_fields.warmup_bootstrap(args))
        async def one_token() -> bool:
            async for out in tm.generate(req, log_metrics=False):
                if out.finished:
                    return out.finish_type != "abort"
            return False

        try:
            ok = await asyncio.wait_for(one_token(), 30)
        except (asyncio.TimeoutError, EngineDeadError):
            ok = False
        if not ok:
            return _status(503)
        return _status(200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        info = server_info_dict(args, state.engine_info)
        # SGLang's internal_states: the scheduler's live state (one entry per scheduler),
        # asked now -- it answers between two steps from counters it keeps (no tensor, no
        # pass over the requests), so a step is never held up; if a long step keeps it
        # from answering within SERVER_INFO_WAIT_S, the latest load report (at most one
        # step old) stands in, marked live=false.
        try:
            live, fresh = await tm.control("get_load", timeout=SERVER_INFO_WAIT_S), True
        except (asyncio.TimeoutError, RuntimeError, EngineDeadError):
            live, fresh = dict(tm.load), False
        info["internal_states"] = [{**live, "live": fresh,
                                    "kv_plan": info.get("kv_plan"),
                                    "server_args": {k: v for k, v in info.items()
                                                    if k not in _NOT_ARGS}}]
        return info

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        check_alive()
        return {"model_path": args.model_path,
                "tokenizer_path": getattr(args, "tokenizer_path", None) or args.model_path,
                "served_model_name": state.model_names[0], "is_generation": True,
                "max_context_len": state.context_len, "preferred_sampling_params": None,
                "weight_version": "default", "has_image_understanding": False,
                "has_audio_understanding": False}

    @app.get("/get_load")
    async def get_load():
        # The scheduler's load as of its latest step (it publishes one at least every 100 ms
        # while busy and one when it goes idle): answered at once, however long a step is.
        check_alive()
        load = dict(tm.load)
        load.setdefault("num_reqs", load.get("num_running_reqs", 0)
                        + load.get("num_waiting_reqs", 0))
        return load

    @app.get("/flush_cache", operation_id="flush_cache_get")
    @app.post("/flush_cache", operation_id="flush_cache_post")
    async def flush_cache():
        result = await tm.control("flush_cache")
        if result.get("flushed"):
            return PlainTextResponse("Cache flushed.\n")
        raise ApiError(400, "cache not flushed: requests are still running")

    @app.post("/abort_request", openapi_extra=body_spec(AbortRequest))
    async def abort_request(request: Request):
        body = await parse_body(request, AbortRequest)
        if body.abort_all:
            count = tm.abort_all()
            state.metrics.on_abort("abort_request", count)
            return {"aborted": count}
        if not body.rid:
            raise bad_request("rid is required unless abort_all is true", "rid")
        rids = [r for r in list(tm.states) if r == body.rid or r.startswith(body.rid + "-")]
        for rid in rids or [body.rid]:
            tm.abort(rid)
        state.metrics.on_abort("abort_request", len(rids))
        return {"aborted": len(rids)}

    @app.get("/debug/kv")
    async def debug_kv():
        """KV pool accounting plus check_integrity(): tests use it to prove no page leaked."""
        return await tm.control("check_integrity")

    @app.get("/debug/dsa_seeds")
    async def debug_dsa_seeds():
        """DSA models: the last PD top-k seeds and the latent rows they point at, per side
        (prefill: at the seed positions; decode: at the decode-local slots). Tests compare
        the two to prove the transfer and the remap; null records for other models."""
        return await tm.control("dsa_seeds")

    @app.get("/debug/grammar")
    async def debug_grammar():
        """Structured output's compiles on every rank: how many each started and how many a
        request's first step found still running (the scheduler holds a request until every
        rank compiled its grammar, so 0). Tests check it under TP."""
        return await tm.control("grammar_stats")

    @app.get("/metrics")
    async def metrics():
        if not getattr(args, "enable_metrics", True):
            return JSONResponse(error_body("metrics are disabled (--no-enable-metrics)",
                                           type_="not_found_error", code=404), status_code=404)
        state.metrics.set_load(tm.load)  # the scheduler's latest report: no round trip
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    parser_models = add_parser_routes(app)  # SGLang's /parse_function_call, ...
    add_request_schemas(app, [ChatCompletionRequest, CompletionRequest, GenerateRequest,
                              AbortRequest, ResponsesRequest, *parser_models])
    return _Guard(app, MAX_BODY_BYTES, getattr(args, "api_key", None))


# How long /server_info waits for the scheduler's live answer before using its last report.
SERVER_INFO_WAIT_S = 1.0
# Keys of server_info_dict that are not server args.
_NOT_ARGS = frozenset({"version", "kv_plan", "resolutions", "quantization_info",
                       "engine_info"})


def _status(code: int) -> Response:
    """Health answers: an empty body with a declared content type (a response without one
    is malformed to strict clients and fuzzers)."""
    return PlainTextResponse("", status_code=code)
