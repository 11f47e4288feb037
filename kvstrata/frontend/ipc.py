"""Messages that cross the process boundaries of the server, and their one codec.

    api server --(ToScheduler)--> scheduler --(ToDetokenizer)--> detokenizer --(ToApi)--> api

Control requests (flush, load, integrity check, health) travel the same path as generation
requests, and their replies are forwarded unchanged by the detokenizer. That keeps one inbound
socket per process, and keeps a reply ordered after every output the scheduler sent before it.

Every message is a tagged msgspec Struct encoded with msgpack: never pickle on a socket.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from kvstrata.protocol import RequestOutput, SamplingParams, SpecCounts
from kvstrata.protocol.engine_request import EngineRequest
from kvstrata.protocol.logprobs import TopLogprob


class _Msg(msgspec.Struct, tag=True, omit_defaults=True):
    pass


# ---- api server -> scheduler -------------------------------------------------------------
# A generation request crosses as the engine's own EngineRequest (protocol/engine_request.py):
# one struct from the HTTP layer to the scheduler, its BootstrapAddr whole.
GenerateReq = EngineRequest


class AbortReq(_Msg):
    rid: str


class ControlReq(_Msg):
    """A request answered by one ControlReply with the same call_id."""
    call_id: int
    # "get_load" | "flush_cache" | "check_integrity" | "engine_info" | "dsa_seeds" |
    # "grammar_stats"
    op: str


class ShutdownReq(_Msg):
    pass


# ---- scheduler -> detokenizer ------------------------------------------------------------
class RegisterDetok(_Msg):
    """Sent by the scheduler before the first output of a request, on the same socket, so
    the detokenizer always knows a request's stop strings before it sees its tokens."""
    rid: str
    stop: list[str]
    skip_special_tokens: bool = True
    # SGLang: a matched stop token (EOS, stop_token_ids) is not part of the text, unless
    # no_stop_trim (its id stays in the output ids either way)
    trim_stop_token: bool = True


class EngineOutputs(_Msg):
    outputs: list[RequestOutput]


# ---- detokenizer -> api server -----------------------------------------------------------
class TextOutput(msgspec.Struct, omit_defaults=True):
    rid: str
    # Text that became final since the previous TextOutput (never half a character, never
    # a possible prefix of a stop string, never the stop string itself).
    text: str
    new_token_ids: list[int]
    finished: bool
    finish_type: str | None = None  # "stop" | "length" | "abort"
    matched_stop: str | int | None = None
    error_message: str | None = None
    error_status: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[TopLogprob]] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[TopLogprob]] | None = None
    spec: SpecCounts | None = None  # speculative decoding counters (None: not speculating)


class TextOutputs(_Msg):
    outputs: list[TextOutput]


class ControlReply(_Msg):
    call_id: int
    ok: bool
    result: dict[str, Any] = {}
    error: str | None = None


class EngineFailure(_Msg):
    """The scheduler's engine loop raised (a bug, an unexpected input): sent ahead of its
    teardown and forwarded unchanged by the detokenizer, so the api server fails requests
    naming the cause rather than whichever process happened to exit first."""
    reason: str


class LoadReport(_Msg):
    """The engine's get_load(), sent by the scheduler after a step (at most every 100 ms
    while busy, and when it goes idle) ahead of that step's outputs, and ahead of every
    ControlReply; forwarded unchanged by the detokenizer. The api server answers /get_load
    and /metrics from its latest copy without waiting behind a long step."""
    load: dict[str, Any]


class ReadyMsg(_Msg):
    """Sent over the start-up pipe once a child process can serve (or failed to start)."""
    process: str
    ok: bool
    error: str | None = None
    info: dict[str, Any] = {}


ToScheduler = Union[EngineRequest, AbortReq, ControlReq, ShutdownReq]
ToDetokenizer = Union[RegisterDetok, EngineOutputs, ControlReply, LoadReport, EngineFailure,
                      ShutdownReq]
ToApi = Union[TextOutputs, ControlReply, LoadReport, EngineFailure]

_encoder = msgspec.msgpack.Encoder()
_decoders = {
    "scheduler": msgspec.msgpack.Decoder(ToScheduler),
    "detokenizer": msgspec.msgpack.Decoder(ToDetokenizer),
    "api": msgspec.msgpack.Decoder(ToApi),
    "ready": msgspec.msgpack.Decoder(ReadyMsg),
}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, receiver: str) -> Any:
    """Decode a message for `receiver` ("scheduler", "detokenizer", "api" or "ready");
    anything that is not one of that receiver's message types raises msgspec.ValidationError."""
    return _decoders[receiver].decode(data)


class IpcPaths(msgspec.Struct, frozen=True):
    """ZMQ endpoints of one server instance (ipc:// files in a private temp dir)."""
    scheduler_in: str
    detokenizer_in: str
    api_in: str

    @classmethod
    def in_dir(cls, directory: str) -> "IpcPaths":
        return cls(
            scheduler_in=f"ipc://{directory}/scheduler_in",
            detokenizer_in=f"ipc://{directory}/detokenizer_in",
            api_in=f"ipc://{directory}/api_in",
        )
