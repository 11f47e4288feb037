"""A checkpoint's config.json as attributes, without transformers' config classes (no torch).

Why: importing any transformers config class (transformers 5) pulls torch.distributed.tensor
and sympy -- about 3 s of imports in every scheduler process, a quarter of a small server's
start on 2 cores. For the decoder families our runner builds (llama, mistral, qwen2, qwen3,
gemma3_text, gemma2) this reads config.json, fills in the fields a transformers class would
default (the table below, checked against transformers' classes by
tests/unit/test_hf_config.py) and derives what their __init__ derives (kv heads, head_dim,
rope parameters, qwen sliding window, Gemma's layer types and per-layer-type rope).
Anything else (DeepSeek-V3.2, unknown model types) goes through AutoConfig as before.

Only the fields the runner reads are guaranteed to match AutoConfig (tests compare them on
real and tiny checkpoints); the rest of config.json is passed through as written.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# Class defaults of the fields the runner reads (transformers 5: LlamaConfig() etc.), for
# fields a config.json may leave out.
_COMMON = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_scaling": None,
           "rope_parameters": None, "dtype": None, "architectures": None,
           "hidden_act": "silu"}
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "intermediate_size": 11008, "max_position_embeddings": 2048,
              "attention_bias": False, "mlp_bias": False, "bos_token_id": 1,
              "eos_token_id": 2},
    "mistral": {**_COMMON, "intermediate_size": 14336, "max_position_embeddings": 131072,
                "num_key_value_heads": 8, "sliding_window": 4096, "bos_token_id": 1,
                "eos_token_id": 2},
    "qwen2": {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016,
              "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "sliding_window": 4096,
              "use_sliding_window": False, "max_window_layers": 28, "bos_token_id": None,
              "eos_token_id": None},
    "qwen3": {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016,
              "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "head_dim": 128, "attention_bias": False,
              "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28,
              "bos_token_id": None, "eos_token_id": None},
}
# Gemma (Gemma3TextConfig, Gemma2Config): hidden_activation instead of hidden_act, and the
# fields of its attention (runner/models/gemma.py).
_GEMMA = {**{k: v for k, v in _COMMON.items() if k != "hidden_act"},
          "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
          "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
          "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
          "layer_types": None, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}
CLASS_DEFAULTS["gemma3_text"] = {**_GEMMA, "vocab_size": 262208,
                                 "max_position_embeddings": 131072,
                                 "final_logit_softcapping": None,
                                 "attn_logit_softcapping": None,
                                 "use_bidirectional_attention": False}
CLASS_DEFAULTS["gemma2"] = {**_GEMMA, "vocab_size": 256000, "max_position_embeddings": 8192,
                            "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
                            "use_bidirectional_attention": None}
_DEFAULT_ROPE_THETA = 10000.0
# Gemma 3's rope bases when a config names none: global layers, local (sliding) layers.
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


class HFConfig:
    """config.json as attributes (see the module doc); `to_dict()` gives the fields back."""

    def __init__(self, raw: dict[str, Any]):
        model_type = raw.get("model_type")
        if model_type not in CLASS_DEFAULTS:
            raise ValueError(f"no built-in config reader for model_type {model_type!r}")
        values = {**CLASS_DEFAULTS[model_type], **raw}
        values.pop("torch_dtype", None)
        if "torch_dtype" in raw and raw.get("dtype") is None:
            values["dtype"] = raw["torch_dtype"]  # transformers 4's name for it
        if values["num_key_value_heads"] is None:
            values["num_key_value_heads"] = values["num_attention_heads"]
        if values.get("head_dim") is None:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        if model_type in ("gemma3_text", "gemma2"):
            _gemma_layer_types(values)
        if model_type == "gemma3_text":
            values["rope_parameters"] = _gemma3_rope_parameters(values)
            values.pop("rope_local_base_freq", None)
        else:
            values["rope_parameters"] = _rope_parameters(values)
        values["rope_scaling"] = values["rope_parameters"]  # transformers 5 mirrors them
        values.pop("rope_theta", None)
        if model_type in ("qwen2", "qwen3"):
            if not values.get("use_sliding_window"):
                values["sliding_window"] = None  # qwen: a window only with use_sliding_window
            if values.get("layer_types") is None:  # Qwen2Config.__post_init__'s derivation
                values["layer_types"] = [
                    "sliding_attention" if values["sliding_window"] is not None
                    and i >= values["max_window_layers"] else "full_attention"
                    for i in range(values["num_hidden_layers"])]
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"HFConfig({self.__dict__.get('model_type')!r})"


def _rope_parameters(values: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's standardisation: one dict with rope_type and rope_theta, from
    `rope_parameters`, or from the older `rope_theta` + `rope_scaling` (whose "type" key is
    the older spelling of "rope_type")."""
    params = dict(values.get("rope_parameters") or {})
    scaling = values.get("rope_scaling")
    if not params and scaling:
        params = dict(scaling)
    params.setdefault("rope_type", params.get("type") or "default")
    params.setdefault("rope_theta", values.get("rope_theta", _DEFAULT_ROPE_THETA))
    return params


def _gemma_layer_types(values: dict[str, Any]) -> None:
    """Gemma3TextConfig / Gemma2Config.__post_init__: layer_types when config.json has none
    (Gemma 3: every `sliding_window_pattern`-th layer global, default 6; Gemma 2: every
    second), and a bidirectional model's window as transformers converts it."""
    if values["model_type"] == "gemma3_text" and values.get("use_bidirectional_attention"):
        values["sliding_window"] = values["sliding_window"] // 2 + 1
    if values.get("layer_types") is None:
        every = values.get("sliding_window_pattern", 6) if (
            values["model_type"] == "gemma3_text") else 2
        values["layer_types"] = ["sliding_attention" if (i + 1) % every else "full_attention"
                                 for i in range(values["num_hidden_layers"])]


def _gemma3_rope_parameters(values: dict[str, Any]) -> dict[str, Any]:
    """Gemma3TextConfig's rope: one dict per layer type. An older config's rope_scaling
    updates the global layers' dict (its "type" key does not replace the rope_type already
    there, as in transformers), rope_theta is the global base and rope_local_base_freq the
    local one; then transformers' standardisation of each nested dict."""
    params = {k: (dict(v) if isinstance(v, dict) else v)
              for k, v in (values.get("rope_parameters") or {}).items()}
    if not params:
        params = {t: {"rope_type": "default"} for t in _GEMMA3_THETA}
    for layer_type in _GEMMA3_THETA:
        if params.get(layer_type) is None:
            params[layer_type] = {"rope_type": "default"}
    if values.get("rope_scaling"):
        params["full_attention"].update(values["rope_scaling"])
    params["full_attention"].setdefault(
        "rope_theta", values.get("rope_theta", _GEMMA3_THETA["full_attention"]))
    params["sliding_attention"].setdefault(
        "rope_theta", values.get("rope_local_base_freq", _GEMMA3_THETA["sliding_attention"]))
    for layer_type in set(values["layer_types"]) & set(_GEMMA3_THETA):
        nested = params[layer_type]
        nested.setdefault("rope_type", nested.get("type", "default"))
        if nested["rope_type"] in ("llama3", "yarn", "longrope"):
            nested.setdefault("original_max_position_embeddings",
                              values["max_position_embeddings"])
    return params


def layer_windows(config: Any) -> list[int | None] | None:
    """Per layer its sliding window W (the query at position p sees keys p - W + 1 .. p,
    transformers' sliding_window) or None for full attention; None when every layer is full.
    As transformers' models apply it: Mistral to every layer (MistralAttention reads
    config.sliding_window and ignores layer_types); Qwen2 / Qwen3 (and any config with
    layer_types) to the "sliding_attention" layers, a Qwen window only with
    use_sliding_window."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if getattr(config, "model_type", None) == "mistral" or types is None:
        windows = [int(window)] * config.num_hidden_layers
    else:
        windows = [int(window) if t == "sliding_attention" else None for t in types]
    return windows if any(w is not None for w in windows) else None


def read_hf_config(path: str) -> HFConfig | None:
    """The directory's config.json through HFConfig, or None when this reader does not
    cover it (the caller then uses AutoConfig)."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
        raw = json.load(fh)
    if raw.get("model_type") not in CLASS_DEFAULTS or "text_config" in raw:
        return None
    return HFConfig(raw)


def read_generation_eos(path: str) -> Any:
    """eos_token_id of generation_config.json (int, list or None), as GenerationConfig reads
    it; None when the file is missing or unreadable."""
    try:
        with open(os.path.join(path, "generation_config.json"), encoding="utf-8") as fh:
            return json.load(fh).get("eos_token_id")
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class ModelDims:
    """The dense decoder's shapes a config names (no torch: start-up measurements read them
    before any model is built)."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_config(cls, c: Any) -> "ModelDims":
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads, head_dim=head_dim,
            vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(c, "attention_bias", False)),
            mlp_bias=bool(getattr(c, "mlp_bias", False)))


__all__ = ["CLASS_DEFAULTS", "HFConfig", "ModelDims", "read_generation_eos", "read_hf_config"]
