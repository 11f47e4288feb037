"""The config of a DeepSeek V2 / V3 GGUF file (llama.cpp arch `deepseek2`, written by
convert_hf_to_gguf.py's DeepseekV2Model) read the way llama.cpp reads it.

The converter writes MLA as MQA with larger heads (attention.head_count_kv 1, key_length
kv_lora_rank + rope dims, value_length kv_lora_rank) and the real head sizes beside it
(attention.key_length_mla, value_length_mla); the ranks (attention.q_lora_rank, absent for
V2-Lite's full q projection, attention.kv_lora_rank), rope.dimension_count (the rope part of
a head), leading_dense_block_count, the experts (expert_count, expert_used_count,
expert_shared_count, expert_feed_forward_length, expert_weights_scale, expert_weights_norm,
expert_gating_func, expert_group_count / _used_count). The router: sigmoid scores
(expert_gating_func 2) with the exp_probs_b correction, in groups, are V3's
(DeepseekV3ForCausalLM), softmax ones (1, or no key: llama.cpp's default for V2 files) V2's
greedy top-k. Rope: llama.cpp rotates interleaved pairs, as transformers'
V2 and V3 (rope_interleave) do with the converter's rows, which it leaves in place.
YaRN: `_rope`. What llama.cpp would read that this does not build is refused by key: a rope
scaling other than YaRN, YaRN without its log multiplier, expert groups with V2's softmax
gating, renormalised V2 weights, a layer without experts after the dense ones.
"""
from __future__ import annotations

from typing import Any

from kvstrata.config.gguf_header import yarn_parameters

ARCH = "deepseek2"
_ROPE_BASE = 10000.0
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2
KEYS = ("attention.key_length_mla", "attention.value_length_mla", "attention.q_lora_rank",
        "attention.kv_lora_rank", "expert_group_count", "expert_group_used_count",
        "rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow")


def deepseek_fields(get, need, dims: dict, n_layer: int, n_embd: int, n_head: int
                    ) -> dict[str, Any]:
    """config.json fields beyond the sizes gguf_families.family_fields reads."""
    rope = int(need("rope.dimension_count"))
    key_mla, value_mla = int(need("attention.key_length_mla")), \
        int(need("attention.value_length_mla"))
    gating = int(get("expert_gating_func", _GATING_SOFTMAX) or _GATING_SOFTMAX)
    if gating not in (_GATING_SOFTMAX, _GATING_SIGMOID):
        raise ValueError(f"GGUF {ARCH}: expert_gating_func {gating} is not supported")
    v3 = gating == _GATING_SIGMOID
    groups = int(get("expert_group_count", 1) or 1)
    groups_used = int(get("expert_group_used_count", groups) or groups)
    if groups > 1 and not v3:
        raise ValueError(f"GGUF {ARCH}: expert_group_count {groups} with softmax gating (V2's "
                         f"group_limited_greedy) is not supported")
    dense = int(get("leading_dense_block_count", 0) or 0)
    layers = [i for i in range(n_layer) if f"blk.{i}.ffn_gate_inp.weight" not in dims]
    if layers != list(range(dense)):
        raise ValueError(f"GGUF {ARCH}: layers without experts {layers[:4]} are not the "
                         f"leading_dense_block_count {dense} first ones")
    scale = float(get("expert_weights_scale", 1.0) or 1.0)
    norm = bool(get("expert_weights_norm", False))
    if not v3 and norm:
        raise ValueError(f"GGUF {ARCH}: expert_weights_norm with softmax gating (V2) is not "
                         f"supported")
    q_lora = get("attention.q_lora_rank")
    fields: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "num_key_value_heads": n_head, "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": key_mla - rope,
        "v_head_dim": value_mla, "head_dim": rope,
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        "n_routed_experts": int(need("expert_count")),
        "num_experts_per_tok": int(need("expert_used_count")),
        "n_shared_experts": int(get("expert_shared_count", 0) or 0),
        "first_k_dense_replace": dense, "routed_scaling_factor": scale,
        # V3's group-limited top-k (llama.cpp's build_moe_ffn: groups ranked by their two
        # best biased scores, as transformers')
        "n_group": groups, "topk_group": groups_used, "attention_bias": False,
        "rope_parameters": _rope(get, float(get("rope.freq_base", _ROPE_BASE)))}
    if v3:
        fields.update(norm_topk_prob=norm, rope_interleave=True)
    else:
        fields["topk_method"] = "greedy"
    return fields


def _rope(get, base: float) -> dict[str, Any]:
    """YaRN as llama.cpp's deepseek2 graph runs it: the rotation's magnitude scaling cancelled
    (its attn_factor 1 / (1 + 0.1 ln s)) and the softmax scale times (1 + log_mul ln s)^2,
    log_mul = 0.1 * mscale_all_dim (the converter's yarn_log_multiplier): transformers'
    DeepSeek YaRN with mscale == mscale_all_dim, as V2-Lite's and V3's configs have them."""
    kind = get("rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": base}
    if kind != "yarn":
        raise ValueError(f"GGUF {ARCH}: rope.scaling.type {kind!r} is not supported")
    log_mul, orig = get("rope.scaling.yarn_log_multiplier"), \
        get("rope.scaling.original_context_length")
    if log_mul is None or orig is None:  # transformers would scale the rotation instead
        raise ValueError(f"GGUF {ARCH}: YaRN without rope.scaling.yarn_log_multiplier and "
                         f"rope.scaling.original_context_length is not supported")
    mscale = float(log_mul) / 0.1
    return {**yarn_parameters(get, base, orig), "mscale": mscale, "mscale_all_dim": mscale}


__all__ = ["ARCH", "KEYS", "deepseek_fields"]
