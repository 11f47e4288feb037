"""The config fields of the MoE members of the llama family (moe_decoder.py: Qwen3-MoE,
Qwen2-MoE, Mixtral, GLM-4.5) that kvstrata builds, and the refusal of the others: a field we
do not implement could change the arithmetic, and ignoring it would serve a different model
than the checkpoint's (deepseek_config.py does the same for DeepSeek).

What each family honours, as transformers' modeling_<family> reads it:
  every family  dims, rope (rope.py refuses an unknown rope_type by name), tied embeddings,
                num_experts_per_tok, hidden_act silu
  Qwen3-MoE     q/k norms, attention_bias (q/k/v/o), norm_topk_prob, the dense layers of
                mlp_only_layers / decoder_sparse_step, use_sliding_window + sliding_window
                on every layer (transformers' Qwen3-MoE reads no layer_types)
  Qwen2-MoE     qkv_bias, the gated shared expert, norm_topk_prob, mlp_only_layers /
                decoder_sparse_step, sliding windows on the "sliding_attention" layer_types
                (derived from use_sliding_window / max_window_layers by its config class)
  Mixtral       sliding_window on every layer; no biases anywhere
  GLM-4.5       V3's grouped sigmoid router (n_group, topk_group, routed_scaling_factor,
                norm_topk_prob), shared experts, first_k_dense_replace, attention_bias on
                q/k/v, use_qk_norm, partial rotary; its MTP layers are not run (transformers
                does not run them either)
"""
from __future__ import annotations

from typing import Any

# What any transformers config carries (PreTrainedConfig's own fields, token ids, metadata):
# none of it changes greedy inference.
_GENERIC = {
    "_name_or_path", "architectures", "model_type", "dtype", "torch_dtype",
    "transformers_version", "chunk_size_feed_forward", "id2label", "label2id",
    "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type",
    "return_dict", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
    "initializer_range", "auto_map", "tokenizer_class",
    # training only: dropout is off at inference, the router's auxiliary loss and Mixtral's
    # jitter noise (transformers applies it only when self.training) are never computed
    "attention_dropout", "output_router_logits", "router_aux_loss_coef",
    "router_jitter_noise",
    # decided by config/hf_quant.py (a scheme is built or refused by name there)
    "quantization_config",
}
_DIMS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "tie_word_embeddings",
    "num_experts_per_tok",
}
_QWEN = {"moe_intermediate_size", "num_experts", "norm_topk_prob", "decoder_sparse_step",
         "mlp_only_layers", "use_sliding_window", "sliding_window",
         # Qwen2-MoE: derives layer_types from it; Qwen3-MoE: no model code reads it (real
         # Qwen3-MoE configs carry it beside use_sliding_window false)
         "max_window_layers"}
KNOWN: dict[str, set[str]] = {
    # num_local_experts: Qwen3MoeConfig's own name for num_experts (its attribute_map)
    "qwen3_moe": _QWEN | {"attention_bias", "num_local_experts"},
    "qwen2_moe": _QWEN | {"qkv_bias", "shared_expert_intermediate_size", "layer_types"},
    "mixtral": {"num_local_experts", "sliding_window"},
    "glm4_moe": {"moe_intermediate_size", "n_routed_experts", "n_shared_experts", "n_group",
                 "topk_group", "norm_topk_prob", "routed_scaling_factor",
                 "first_k_dense_replace", "attention_bias", "use_qk_norm",
                 "partial_rotary_factor", "num_nextn_predict_layers"},
}
_NO_BIAS = (False,), "transformers' model builds these projections without biases"
_SILU = ("silu",), "the experts and MLPs are silu(gate) * up"
# Per family: fields accepted only with some values -> (values, why).
FIXED: dict[str, dict[str, tuple[tuple, str]]] = {
    "qwen3_moe": {"hidden_act": _SILU, "mlp_bias": _NO_BIAS},
    # Qwen2-MoE's biases are qkv_bias's (q/k/v, never o_proj)
    "qwen2_moe": {"hidden_act": _SILU, "mlp_bias": _NO_BIAS, "attention_bias": _NO_BIAS},
    "mixtral": {"hidden_act": _SILU, "mlp_bias": _NO_BIAS, "attention_bias": _NO_BIAS},
    "glm4_moe": {"hidden_act": _SILU, "mlp_bias": _NO_BIAS},
}


def check_moe_config(config: Any) -> None:
    """ValueError naming the config fields of this MoE family that kvstrata does not build.
    `config`: the transformers config (its to_dict() holds config.json's fields, unknown ones
    included, and the class defaults). A field set to None is unset (transformers' reading)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in KNOWN:
        raise ValueError(f"MoE decoder: model_type {model_type!r} is not one of "
                         f"{', '.join(sorted(KNOWN))}")
    fields = {k: v for k, v in config.to_dict().items() if v is not None}
    fixed = FIXED[model_type]
    refuse_fields((getattr(config, "architectures", None) or [model_type])[0], fields,
                  _GENERIC | _DIMS | KNOWN[model_type], fixed)


def refuse_fields(arch: str, fields: dict, known: set[str],
                  fixed: dict[str, tuple[tuple, str]]) -> None:
    """ValueError naming the fields that are neither `known` nor `fixed`, then the first
    `fixed` field with a value outside its (values, why) (DeepSeek's configs too)."""
    unknown = sorted(k for k in fields if k not in known and k not in fixed)
    if unknown:
        raise ValueError(f"{arch}: config fields not implemented by kvstrata: {unknown} "
                         f"(refusing rather than ignoring them)")
    for key, (values, why) in fixed.items():
        if key in fields and fields[key] not in values:
            raise ValueError(f"{arch}: {key}={fields[key]!r} is not supported (only "
                             f"{', '.join(repr(v) for v in values)}: {why})")


__all__ = ["FIXED", "KNOWN", "check_moe_config", "refuse_fields"]
