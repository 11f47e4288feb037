"""Request/response models of the HTTP API: OpenAI-compatible and SGLang-native /generate.

Requests are parsed with extra="forbid" in strict JSON mode: an unknown field or a wrong
type is a 400 that names the field, never a silent accept-and-ignore. OpenAI fields we know
but do not implement are accepted only at their "off" value (null), because clients and
sglang-router serialise a fixed schema with nulls; any other value is refused by name.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# Known OpenAI fields we do not implement: accepted only when null.
UNIMPLEMENTED_WHEN_SET = (
    "logit_bias", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "response_format", "service_tier", "store", "metadata", "modalities", "audio",
    "prediction", "reasoning_effort", "suffix", "best_of", "web_search_options",
)


def unimplemented_field(body: Any) -> str | None:
    """The first known-but-unimplemented field that is set to something other than null."""
    if not isinstance(body, dict):
        return None
    for name in UNIMPLEMENTED_WHEN_SET:
        if body.get(name) is not None:
            if name == "best_of" and body[name] == 1:
                continue  # best_of=1 is the default behaviour
            return name
    return None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields shared by chat and completions requests."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # SGLang/vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    rid: str | None = None
    # Prefill/decode disaggregation (sglang-router adds these); carried, no effect yet.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # Known OpenAI fields, refused unless null (see unimplemented_field).
    logit_bias: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    modalities: list | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    web_search_options: dict | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class GenerateRequest(_Strict):
    """SGLang's native /generate: one prompt, or a batch (a list of texts / of id lists, with
    one sampling_params dict for all or a list of them, and optionally a list of rids)."""
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    rid: str | list[str] | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class AbortRequest(_Strict):
    rid: str = ""
    abort_all: bool = False


# ---- responses (plain dict builders: cheaper than models on the streaming hot path) -----
def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def model_list(model_names: list[str], max_model_len: int | None) -> dict:
    created = int(time.time())
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "kvstrata",
         "root": name, "max_model_len": max_model_len} for name in model_names]}


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
