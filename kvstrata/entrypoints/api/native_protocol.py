"""Request models of the SGLang-native routes: /generate (every field of SGLang's
GenerateReqInput is declared; see protocol_base for the rule on fields we do not implement)
and /abort_request, plus the SGLang sampling_params keys kvstrata accepts only when off.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from kvstrata.entrypoints.api.errors import bad_request
from kvstrata.entrypoints.api.protocol_base import (Int64, Port, RequestModel, StrictModel,
                                                Text, TokenIds, UInt64, declare_off_values,
                                                is_off)

HiddenStates = bool | Literal["last"]


def _generate_schema(schema: dict[str, Any], cls) -> None:
    declare_off_values(schema, cls)
    schema["oneOf"] = [{"required": ["text"]}, {"required": ["input_ids"]}]


class NativeSamplingParams(BaseModel):
    """SGLang's sampling_params dict with SGLang's types, so that a wrongly typed value is a
    400 naming `sampling_params.<key>` (and /openapi.json shows fuzzers the types). Unknown
    keys pass through here: native_sampling_dict and SamplingParams.from_dict refuse them by
    name; value ranges are SamplingParams' job."""
    model_config = ConfigDict(extra="allow", strict=True)
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    seed: int | None = None  # kvstrata's name (and vLLM's) for sampling_seed
    logprobs: int | None = None  # kvstrata: what return_logprob/top_logprobs_num set


class GenerateRequest(RequestModel):
    """SGLang's native /generate: one prompt, or a batch (a list of texts / of id lists, with
    one sampling_params dict for all or a list of them, and optionally a list of rids)."""
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_generate_schema)
    model: str | None = None  # sglang-router sends it (null unless the client set it)
    text: Text | list[Text] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    stream: bool = False
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    logprob_start_len: int | None = None
    rid: str | list[str] | None = None
    return_text_in_logprobs: bool = False
    log_metrics: bool = True  # false: not counted in /metrics (SGLang: health checks)
    no_logs: bool = False  # kvstrata never logs request contents: nothing to turn off
    # Prefill/decode disaggregation (a PD router adds them; a list: one per prompt of a batch).
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: Port | list[Port | None] | None = None
    bootstrap_room: UInt64 | list[UInt64] | None = None
    # Known SGLang fields, accepted only at their default.
    session_id: str | None = None
    input_embeds: list[list[float]] | list[list[list[float]]] | None = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: list[str] | list[list[str]] | None = None
    mm_content_hashes: list[str | None] | list[list[str | None]] | None = None
    use_audio_in_video: bool = False
    video_config: dict[str, Any] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_sampling_mask: bool | list[bool] | None = None
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    return_hidden_states: HiddenStates | list[HiddenStates] = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    modalities: list[str] | None = None
    session_params: dict[str, Any] | None = None
    lora_path: str | list[str | None] | None = None
    lora_id: str | list[str | None] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    positional_embed_overrides: Any = None
    bootstrap_pair_key: str | list[str | None] | None = None
    decode_tp_size: int | list[int | None] | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    kv_router_hint: dict[str, Any] | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    http_worker_ipc: str | None = None
    background: bool = False
    require_reasoning: bool = False
    max_thinking_tokens: int | None = None
    priority: Int64 | None = None
    extra_key: str | list[str] | None = None
    custom_labels: dict[str, str] | None = None
    return_bytes: bool = False
    return_entropy: bool = False
    return_prompt_token_ids: bool = False
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    need_wait_for_mm_inputs: bool | None = None
    num_items_assigned: dict[str, list[int]] | None = None
    encoder_urls: list[str] | None = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    image_max_dynamic_patch: int | None = None
    video_max_dynamic_patch: int | None = None
    images_config: dict[str, Any] | None = None
    multi_item_delimiter_indices: list[int] | list[list[int]] | None = None
    cache_salt: str | list[str] | None = None

    NOT_IMPLEMENTED = frozenset({
        "session_id", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
        "mm_content_hashes", "use_audio_in_video", "video_config",
        "return_sampling_mask", "return_flat_raw_top_logprobs",
        "return_flat_raw_top_logprobs_b64", "return_hidden_states", "return_routed_experts",
        "routed_experts_start_len", "return_indexer_topk", "modalities", "session_params",
        "lora_path", "lora_id", "custom_logit_processor", "positional_embed_overrides",
        "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "data_parallel_rank",
        "disagg_prefill_dp_rank", "kv_router_hint", "routing_key", "conversation_id",
        "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens",
        "custom_labels", "return_bytes", "return_entropy",
        "return_prompt_token_ids", "external_trace_header", "received_time",
        "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch",
        "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
        "images_config", "multi_item_delimiter_indices"})
    # An empty list means "no images" to SGLang too.
    ALSO_OFF = {name: ([],) for name in ("image_data", "video_data", "audio_data")}


class AbortRequest(StrictModel):
    rid: str = ""
    abort_all: bool = False


# SGLang sampling_params keys kvstrata does not implement, with their off value. (Keys neither
# SGLang nor kvstrata knows are refused by SamplingParams.from_dict.)
SGLANG_SAMPLING_OFF: dict[str, Any] = {
    # n: parallel samples, which native_batch.py expands into one request each (n = 1)
    "n": 1, "custom_params": None,
}
# Keys that change nothing here, as in SGLang in the same configuration: HF's fast
# tokenizers (what kvstrata decodes with) ignore spaces_between_special_tokens.
SGLANG_SAMPLING_NO_OP = frozenset({"spaces_between_special_tokens"})


def native_sampling_dict(
        sampling_params: NativeSamplingParams | dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling_params dict -> kvstrata's SamplingParams fields: SGLang-only keys
    must be off (then dropped); `sampling_seed` is SGLang's name for `seed`."""
    if isinstance(sampling_params, NativeSamplingParams):
        sampling_params = sampling_params.model_dump(exclude_unset=True)
    out = {}
    for key, value in sampling_params.items():
        param = f"sampling_params.{key}"
        if key in SGLANG_SAMPLING_NO_OP:
            continue
        if key in SGLANG_SAMPLING_OFF:
            if not is_off(value, SGLANG_SAMPLING_OFF[key]):
                raise bad_request(f"not implemented yet: {param}", param)
            continue
        if key in ("seed", "sampling_seed"):
            if value is None:
                continue
            if "seed" in out:
                raise bad_request("give one of sampling_params.seed and "
                                  "sampling_params.sampling_seed", param)
            key = "seed"
        out[key] = value
    return out
