"""The config of a gpt-oss GGUF file (llama.cpp arch `gpt-oss`, written by convert_hf_to_gguf.py's
GptOssModel) read the way llama.cpp reads it (its llama_model_openai_moe hparams and graph).

transformers converts this arch's config only in part (it misses the window, the head size,
the expert width), so every field the model reads is set here from the file:
  - sizes: block_count, embedding_length, attention.head_count / head_count_kv,
    attention.key_length (head_dim; llama.cpp's default n_embd / n_head), expert_count,
    expert_used_count, expert_feed_forward_length (each expert's width), context_length,
    attention.layer_norm_rms_epsilon;
  - windows: attention.sliding_window (required, as llama.cpp requires it) on the layers
    llama.cpp's set_swa_pattern marks local: period `attention.sliding_window_pattern`
    (default 2: even layers local, odd global -- gpt-oss's layer_types), or a flag per layer;
  - RoPE: rope.freq_base on every layer, YaRN from rope.scaling.type / .factor /
    .original_context_length / .yarn_beta_fast / .yarn_beta_slow (llama.cpp's defaults 32 / 1).
    YaRN's ramp is transformers' gpt-oss one (`truncate` false, as every released gpt-oss
    config says and SGLang reads it; ggml floors / ceils the ramp's ends, a file cannot say
    which it was trained with);
  - the expert SwiGLU: llama.cpp's fixed alpha 1.702 and limit 7.0 (transformers' defaults;
    the file has no key for them).
What llama.cpp would apply but this model does not build is refused by key: a different
rope base on the local layers (rope.freq_base_swa), a YaRN attention or extrapolation factor,
a rope over part of the head (rope.dimension_count), a value size other than the key size,
a rope scaling other than none / yarn, expert weights scaled (expert_weights_scale).
"""
from __future__ import annotations

from typing import Any

from kvstrata.config.gguf_header import arch_getters, yarn_parameters

ARCH = "gpt-oss"
ARCHITECTURE = "GptOssForCausalLM"
SWIGLU_LIMIT = 7.0  # llama.cpp's build_moe_ffn constant for LLM_FFN_SWIGLU_OAI_MOE
_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train default
_SWA_PERIOD = 2
KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length",
        "expert_feed_forward_length", "expert_count", "expert_used_count",
        "expert_weights_scale", "attention.head_count", "attention.head_count_kv",
        "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
        "attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base",
        "rope.freq_base_swa", "rope.dimension_count", "rope.scaling.type",
        "rope.scaling.factor", "rope.scaling.original_context_length",
        "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
        "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor")


def gpt_oss_fields(meta: dict[str, Any], layer_types) -> dict[str, Any]:
    """config.json fields of a gpt-oss file from its metadata. `layer_types(arch, n_layer,
    pattern, default_period)`: llama.cpp's set_swa_pattern (config/gguf_config.py)."""
    get, need = arch_getters(meta, ARCH)

    n_layer, n_embd = int(need("block_count")), int(need("embedding_length"))
    n_head, n_kv = need("attention.head_count"), get("attention.head_count_kv")
    if isinstance(n_head, list) or isinstance(n_kv, list):
        raise ValueError(f"GGUF {ARCH}: a head count per layer is not supported")
    n_kv = n_head if n_kv is None else n_kv
    head_dim = int(get("attention.key_length", n_embd // n_head))
    _refuse(get, head_dim)
    base = float(get("rope.freq_base", _ROPE_BASE))
    return {
        "architectures": [ARCHITECTURE], "model_type": "gpt_oss",
        "num_hidden_layers": n_layer, "hidden_size": n_embd,
        "num_attention_heads": int(n_head), "num_key_value_heads": int(n_kv),
        "head_dim": head_dim, "attention_bias": True,
        "intermediate_size": int(get("expert_feed_forward_length",
                                     need("feed_forward_length"))),
        "num_local_experts": int(need("expert_count")),
        "num_experts_per_tok": int(need("expert_used_count")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "sliding_window": int(need("attention.sliding_window")),
        "layer_types": layer_types(ARCH, n_layer, get("attention.sliding_window_pattern"),
                                   _SWA_PERIOD),
        "swiglu_limit": SWIGLU_LIMIT,
        **({"max_position_embeddings": int(get("context_length"))}
           if get("context_length") else {}),
        "rope_parameters": _rope(get, base)}


def _refuse(get, head_dim: int) -> None:
    """What llama.cpp would read from a gpt-oss file that this model does not build."""
    value_dim = get("attention.value_length", head_dim)
    if int(value_dim) != head_dim:
        raise ValueError(f"GGUF {ARCH}: attention.value_length {value_dim} != key_length "
                         f"{head_dim} is not supported")
    rot = get("rope.dimension_count", head_dim)
    if int(rot) != head_dim:
        raise ValueError(f"GGUF {ARCH}: rope.dimension_count {rot} (a rope over part of the "
                         f"head of {head_dim}) is not supported")
    swa_base = get("rope.freq_base_swa")
    if swa_base is not None and float(swa_base) != float(get("rope.freq_base", _ROPE_BASE)):
        raise ValueError(f"GGUF {ARCH}: rope.freq_base_swa {swa_base} (another rope base on "
                         f"the sliding layers) is not supported")
    # present at all: llama.cpp multiplies it into YaRN's scale, transformers replaces it
    if get("rope.scaling.yarn_attn_factor") is not None:
        raise ValueError(f"GGUF {ARCH}: rope.scaling.yarn_attn_factor is not supported")
    ext = get("rope.scaling.yarn_ext_factor")
    if ext is not None and float(ext) != 1.0:
        raise ValueError(f"GGUF {ARCH}: rope.scaling.yarn_ext_factor {ext} is not supported "
                         f"(1: transformers' YaRN)")
    scale = get("expert_weights_scale")  # llama.cpp scales the routing weights unless 0 / 1
    if scale is not None and float(scale) not in (0.0, 1.0):
        raise ValueError(f"GGUF {ARCH}: expert_weights_scale {scale} is not supported")


def _rope(get, base: float) -> dict[str, Any]:
    kind = get("rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": base}
    if kind != "yarn":
        raise ValueError(f"GGUF {ARCH}: rope.scaling.type {kind!r} is not supported (none or "
                         f"yarn, as gpt-oss checkpoints convert)")
    orig = get("rope.scaling.original_context_length")
    if orig is None:
        raise ValueError(f"GGUF {ARCH}: YaRN without rope.scaling.original_context_length")
    return {**yarn_parameters(get, base, orig), "truncate": False}


__all__ = ["ARCH", "ARCHITECTURE", "KEYS", "SWIGLU_LIMIT", "gpt_oss_fields"]
