"""Request/response models of the OpenAI-compatible API (/v1/chat/completions,
/v1/completions), with every field of SGLang's ChatCompletionRequest and CompletionRequest
declared (see protocol_base for the rule on fields we do not implement). The native
/generate models live in native_protocol.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator

from kvstrata.entrypoints.api.protocol_base import (Int64, Port, RequestModel, StrictModel,
                                                Text, TokenId, TokenIds, UInt64)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(RequestModel):
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
    # SGLang extras, implemented
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool = False
    rid: str | list[str] | None = None  # a list (one per choice) is not implemented
    # Prefill/decode disaggregation (a PD router adds these): required on a prefill or
    # decode server, ignored on a co-located one (entrypoints/api/pd_fields.py).
    # (A list: one per choice, as sglang-router sends for n > 1.)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: Port | list[Port | None] | None = None
    bootstrap_room: UInt64 | list[UInt64] | None = None
    logit_bias: dict[str, float] | None = None
    # Structured output (entrypoints/api/structured_output.py): OpenAI's response_format,
    # SGLang's regex and ebnf, vLLM's structured_outputs.
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None  # SGLang's: stop once the output matches
    # vLLM's: the prompt's and the answer's token ids in the response
    return_token_ids: bool = False
    # vLLM's (json / regex / choice / grammar / json_object / structural_tag)
    structured_outputs: dict[str, Any] | None = None
    # Known OpenAI fields, accepted only when off.
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # Known SGLang fields, accepted only at their default.
    lora_path: str | list[str | None] | None = None
    session_id: str | None = None
    session_params: dict[str, Any] | None = None
    custom_params: dict[str, Any] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    return_hidden_states: bool | Literal["last"] = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_cached_tokens_details: bool = False
    images_config: dict[str, Any] | None = None
    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    ngram_corpus_id: str | list[str | None] | None = None
    priority: Int64 | None = None

    NOT_IMPLEMENTED = frozenset({
        "service_tier", "store", "metadata", "prediction",
        "web_search_options", "lora_path", "session_id",
        "session_params", "custom_params", "custom_logit_processor", "return_hidden_states",
        "return_routed_experts", "routed_experts_start_len", "return_cached_tokens_details",
        "images_config", "routed_dp_rank", "disagg_prefill_dp_rank",
        "data_parallel_rank", "ngram_corpus_id"})


# ---- chat messages ------------------------------------------------------------------------
class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ThinkingPart(StrictModel):
    type: Literal["thinking", "reasoning"]
    thinking: str | None = None
    text: str | None = None


class ImageURL(StrictModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = "auto"
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    content_hash: str | None = None


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageURL
    modalities: Literal["image", "multi-images", "video"] | None = "image"


class VideoURL(StrictModel):
    url: str
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None


class VideoPart(StrictModel):
    type: Literal["video_url"]
    video_url: VideoURL


class AudioURL(StrictModel):
    url: str


class AudioPart(StrictModel):
    type: Literal["audio_url"]
    audio_url: AudioURL


class ToolReferencePart(StrictModel):
    type: Literal["tool_reference"]
    name: str


_PART_TAGS = {"text": "TextPart", "thinking": "ThinkingPart", "reasoning": "ThinkingPart",
              "image_url": "ImagePart", "video_url": "VideoPart", "audio_url": "AudioPart",
              "tool_reference": "ToolReferencePart"}


def _part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _PART_TAGS.get(kind) if isinstance(kind, str) else None


# Tagged by class name (capitalised, so error locations do not repeat the part type).
ContentPart = Annotated[Union[tuple(Annotated[cls, Tag(cls.__name__)] for cls in (
    TextPart, ThinkingPart, ImagePart, VideoPart, AudioPart, ToolReferencePart))],
    Discriminator(_part_tag, custom_error_type="invalid_part",
                  custom_error_message=f"a content part's type must be one of "
                                       f"{sorted(_PART_TAGS)}")]
# Content part types of a text-only model's input, and what to say about the others.
MEDIA_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}


class FunctionCall(StrictModel):
    name: str
    arguments: str | dict[str, Any]  # OpenAI: a JSON string; some clients send the object


class MessageToolCall(StrictModel):
    """A call an earlier assistant turn made (OpenAI's message.tool_calls item)."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function",
                  "latest_reminder"]
    # A list has at least one part; only an assistant message with tool_calls may go
    # without content (checked in chat_prompt).
    content: str | Annotated[list[ContentPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tools: list[dict[str, Any]] | None = None  # SGLang 2026: tools on a system message

    NOT_IMPLEMENTED = frozenset({"tools"})

    @field_validator("role", mode="before")
    @classmethod
    def _lower_role(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value  # SGLang: case-insensitive

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class FunctionDef(StrictModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDef(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Implemented SGLang chat extras.
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    input_ids: TokenIds | None = None  # pre-tokenised prompt: bypasses the chat template
    # With --reasoning-parser (entrypoints/reasoning.py): false keeps the thinking in the
    # content / sends it in one delta once done; without a parser no-ops, as in SGLang.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # Tool calling (entrypoints/api/tool_choice.py)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Known OpenAI / SGLang chat fields, accepted only when off.
    functions: list[dict[str, Any]] | None = None  # OpenAI's deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    # OpenAI's reasoning_effort: a variable of the chat template (as SGLang and vLLM pass it;
    # templates without it ignore it)
    reasoning_effort: str | float | None = None
    reasoning: dict[str, Any] | None = None
    task: str | None = None
    # SGLang's token-in-token-out fields (not with stream): a choice's prompt_token_ids and
    # its /generate-style meta_info
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    use_audio_in_video: bool = False

    NOT_IMPLEMENTED = _SamplingFields.NOT_IMPLEMENTED | {
        "functions", "function_call", "modalities", "audio", "reasoning", "task",
        "max_dynamic_patch", "min_dynamic_patch", "use_audio_in_video"}
    # An empty list of functions (some agent frameworks send one) offers none.
    ALSO_OFF = {**_SamplingFields.ALSO_OFF, "functions": ([],)}


class CompletionRequest(_SamplingFields):
    prompt: Text | Annotated[list[Text], Field(min_length=1)] | TokenIds \
        | Annotated[list[TokenIds], Field(min_length=1)]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    json_schema: str | None = None
    custom_labels: dict[str, str] | None = None

    NOT_IMPLEMENTED = _SamplingFields.NOT_IMPLEMENTED | {"suffix", "best_of", "custom_labels"}
    ALSO_OFF = {**_SamplingFields.ALSO_OFF, "best_of": (1,)}  # best_of=1: the default


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
