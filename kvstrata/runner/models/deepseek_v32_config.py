"""DeepseekV32 config: the dimensions our model reads, and the refusal of config fields we do
not implement (an unknown field could change the arithmetic; ignoring it would serve a
different model than the checkpoint's)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Fields whose every value we implement (or that do not affect inference).
_KNOWN = {
    # dimensions and structure
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_shared_experts",
    "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_head_dim", "head_dim",
    "n_group", "topk_group", "num_experts_per_tok", "norm_topk_prob",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_scaling",
    "rope_theta", "attention_bias", "index_topk", "index_head_dim", "index_n_heads",
    "first_k_dense_replace", "mlp_layer_types", "layer_types", "tie_word_embeddings",
    # no effect on greedy inference
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "output_router_logits", "attention_dropout", "auto_map",
    # the reference ignores it (its MLPs never have biases)
    "mlp_bias",
}
# Fields we accept only with one value: (value, why).
_FIXED = {
    "hidden_act": ("silu", "the MLPs and experts use SiLU"),
    "scoring_func": ("sigmoid", "the router scores experts with a sigmoid"),
    "topk_method": ("noaux_tc", "group-limited routing with e_score_correction_bias"),
    "moe_layer_freq": (1, "every layer after first_k_dense_replace is MoE"),
    "index_k_norm_type": ("layer", "the indexer's key norm is a LayerNorm"),
}
# Multi-token-prediction layers (checkpoint layers past num_hidden_layers) are not run by the
# reference either: the causal LM's loader skips them; `--speculative-algorithm NEXTN` loads
# them as the draft (runner/models/deepseek_mtp.py), and IndexShare
# (index_share_for_mtp_iteration) is how that draft reuses its top-k.
_MTP = {"num_nextn_predict_layers", "index_share_for_mtp_iteration"}


def check_config(raw: dict) -> None:
    unknown = sorted(k for k in raw if k not in _KNOWN and k not in _FIXED and k not in _MTP)
    if unknown:
        raise ValueError(f"DeepseekV32ForCausalLM: config fields not implemented by kvstrata: "
                         f"{unknown} (refusing rather than ignoring them)")
    for key, (value, why) in _FIXED.items():
        if key in raw and raw[key] != value:
            raise ValueError(f"DeepseekV32ForCausalLM: {key}={raw[key]!r} is not supported "
                             f"(only {value!r}: {why})")
    if raw.get("num_key_value_heads", raw.get("num_attention_heads")) != raw.get(
            "num_attention_heads"):
        raise ValueError("DeepseekV32ForCausalLM: MLA needs num_key_value_heads == "
                         "num_attention_heads")


@dataclass(frozen=True)
class DeepseekDims:
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_config(cls, c: Any) -> "DeepseekDims":
        if c.q_lora_rank is None:
            raise ValueError("DeepseekV32ForCausalLM: q_lora_rank is required (the indexer "
                             "reads the q low-rank residual)")
        if c.index_head_dim < c.qk_rope_head_dim:
            raise ValueError("DeepseekV32ForCausalLM: index_head_dim < qk_rope_head_dim")
        layers = c.num_hidden_layers
        types = getattr(c, "mlp_layer_types", None) or (
            ["dense"] * min(c.first_k_dense_replace, layers)
            + ["sparse"] * max(0, layers - c.first_k_dense_replace))
        if c.n_routed_experts % c.n_group:
            raise ValueError("DeepseekV32ForCausalLM: n_routed_experts must divide into "
                             "n_group groups")
        return cls(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            moe_intermediate_size=c.moe_intermediate_size, num_layers=layers,
            num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
            index_n_heads=c.index_n_heads, index_head_dim=c.index_head_dim,
            index_topk=c.index_topk, n_routed_experts=c.n_routed_experts,
            n_shared_experts=c.n_shared_experts, num_experts_per_tok=c.num_experts_per_tok,
            n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=bool(c.norm_topk_prob),
            routed_scaling_factor=float(c.routed_scaling_factor),
            mlp_layer_types=tuple(types), vocab_size=c.vocab_size,
            rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(c, "attention_bias", False)))
