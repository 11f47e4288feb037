"""The FastAPI app: OpenAI routes, SGLang-native routes, introspection, errors.

Requests are parsed by hand (not FastAPI body injection) so every failure -- malformed JSON,
unknown field, wrong type -- becomes one OpenAI-style 400 naming the field.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

import kvstrata
from kvstrata.entrypoints import serving_openai as so
from kvstrata.entrypoints.errors import ApiError, ClientDisconnected, bad_request
from kvstrata.entrypoints.openai_protocol import (AbortRequest, ChatCompletionRequest,
                                                  CompletionRequest, GenerateRequest,
                                                  error_body, model_list,
                                                  unimplemented_field)
from kvstrata.entrypoints.serving_handlers import (chat_response, completion_response,
                                                   generate_response)
from kvstrata.frontend import ipc
from kvstrata.frontend.tokenizer_manager import EngineDeadError

logger = logging.getLogger(__name__)

# Upper bound on a request body; larger bodies get a 413 before they are read into memory.
MAX_BODY_BYTES = int(os.environ.get("KVSTRATA_MAX_REQUEST_BYTES", str(32 << 20)))
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_from_loc(loc: tuple) -> str | None:
    """pydantic locs include union member names ("str", "list[int]"): drop those."""
    parts = [str(p) for p in loc
             if isinstance(p, int) or (p.isidentifier() and p.lower() not in _TYPE_NAMES
                                       and not p[:1].isupper())]
    return ".".join(parts) or None


async def parse_body(request: Request, model: type[BaseModel]):
    raw = await request.body()
    try:
        obj = msgspec.json.decode(raw) if raw else None
    except msgspec.DecodeError as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    name = unimplemented_field(obj)
    if name is not None:
        raise bad_request(f"not implemented yet: {name}", name)
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param_from_loc(err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown field: {param}", param) from None
        raise bad_request(f"{param}: {err['msg']}", param) from None


_OPEN_PATHS = ("/health", "/metrics")


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

        async def counting_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise ApiError(413, f"request body larger than {self.limit} bytes")
            return message
        return await self.app(scope, counting_receive, send)

    async def _too_large(self, scope, receive, send):
        await JSONResponse(error_body(f"request body larger than {self.limit} bytes",
                                      code=413), status_code=413)(scope, receive, send)


def create_app(state) -> FastAPI:
    """`state` is the launcher's ServerState: tm, server_args, model names, engine info."""
    app = FastAPI(title="kvstrata", version=kvstrata.__version__ if hasattr(
        kvstrata, "__version__") else "0")
    tm = state.tm
    args = state.server_args

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return exc.response()

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

    def check_model(name: str | None) -> None:
        if name is not None and name not in state.model_names:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                           f"{state.model_names[0]!r}", "model", code="model_not_found")

    # ---- OpenAI ------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        check_model(body.model)
        choices = so.chat_choices(tm, body, state.context_len)
        return await chat_response(state, request, body, choices)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        check_model(body.model)
        choices = so.completion_choices(tm, body, state.context_len)
        return await completion_response(state, request, body, choices)

    @app.get("/v1/models")
    async def models():
        return model_list(state.model_names[:1], state.context_len)

    # ---- SGLang native -----------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        body = await parse_body(request, GenerateRequest)
        return await generate_response(state, request, body)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if state.healthy() else 503)

    @app.get("/health_generate")
    async def health_generate():
        if not state.healthy():
            return Response(status_code=503)
        req = ipc.GenerateReq(rid=f"health-{tm.new_rid()}", prompt_ids=tm.encode_prompt("hi"),
                              sampling_params=so.SamplingParams(max_new_tokens=1,
                                                                temperature=0.0))
        async def one_token() -> bool:
            async for out in tm.generate(req):
                if out.finished:
                    return out.finish_type != "abort"
            return False

        try:
            ok = await asyncio.wait_for(one_token(), 30)
        except (asyncio.TimeoutError, EngineDeadError):
            ok = False
        if not ok:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        info = {"version": getattr(kvstrata, "__version__", "0"),
                **_jsonable(dataclasses.asdict(args) if dataclasses.is_dataclass(args)
                            else vars(args)),
                "engine_info": state.engine_info}
        resolutions = getattr(state, "resolutions", None)
        if resolutions:
            info["resolutions"] = _jsonable(resolutions)
        return info

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
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
        if not state.healthy():
            raise EngineDeadError(f"the server is shutting down: {tm.dead_reason}")
        load = dict(tm.load)
        load.setdefault("num_reqs", load.get("num_running_reqs", 0)
                        + load.get("num_waiting_reqs", 0))
        return load

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        result = await tm.control("flush_cache")
        if result.get("flushed"):
            return PlainTextResponse("Cache flushed.\n")
        raise ApiError(400, "cache not flushed: requests are still running")

    @app.post("/abort_request")
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

    @app.get("/metrics")
    async def metrics():
        if not getattr(args, "enable_metrics", True):
            return JSONResponse(error_body("metrics are disabled (--no-enable-metrics)",
                                           type_="not_found_error", code=404), status_code=404)
        state.metrics.set_load(tm.load)  # the scheduler's latest report: no round trip
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    return _Guard(app, MAX_BODY_BYTES, getattr(args, "api_key", None))


def _jsonable(obj):
    return msgspec.json.decode(msgspec.json.encode(obj, enc_hook=repr))
