"""DeepSeek-V2 / V3 / V3.2 configs: the dimensions our model reads, and the refusal of config
fields we do not implement (an unknown field could change the arithmetic; ignoring it would
serve a different model than the checkpoint's).

The three share MLA attention and a MoE with shared experts after `first_k_dense_replace`
dense layers; they differ in what this module checks per architecture:
  V2   softmax router, topk_method greedy or group_limited_greedy (best expert per group),
       no score-correction bias; q_lora_rank may be None (V2-Lite: one q_proj)
  V3   sigmoid router with e_score_correction_bias, group-limited top-k (noaux_tc),
       norm_topk_prob; rope_interleave False rotates halves (Kimi-K2 configs are V3 ones)
  V3.2 V3 plus the DSA lightning indexer (index_* fields; needs q_lora_rank)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.runner.models.moe import MoeDims
from kvstrata.runner.models.moe_config import refuse_fields

V2, V3, V32 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"

# Fields whose every value we implement (or that do not affect inference).
_KNOWN = {
    # dimensions and structure
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_shared_experts",
    "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_head_dim", "head_dim",
    "n_group", "topk_group", "num_experts_per_tok", "max_position_embeddings",
    "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "attention_bias",
    "first_k_dense_replace", "mlp_layer_types", "layer_types", "tie_word_embeddings",
    # no effect on greedy inference (training losses, parallelism hints, metadata)
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "output_router_logits", "attention_dropout", "auto_map", "aux_loss_alpha", "seq_aux",
    "ep_size", "pretraining_tp",
}
_DSA_FIELDS = {"index_topk", "index_head_dim", "index_n_heads"}
_SILU = ("silu",), "the MLPs and experts use SiLU"
_EVERY_LAYER = (1,), "every layer after first_k_dense_replace is MoE"
# Per architecture: fields accepted only with some values -> (values, why).
_FIXED: dict[str, dict[str, tuple[tuple, str]]] = {
    V2: {"hidden_act": _SILU, "moe_layer_freq": _EVERY_LAYER,
         "scoring_func": (("softmax",), "the V2 router scores experts with a softmax"),
         "topk_method": (("greedy", "group_limited_greedy"), "V2's top-k methods"),
         # transformers' DeepseekV2 never renormalises (the contract); released V2 configs
         # say false, so a true one would be served differently by SGLang and transformers
         "norm_topk_prob": ((False, None), "transformers' DeepseekV2 router ignores it"),
         "mlp_bias": ((False, None), "the MLPs are built without biases")},
    V3: {"hidden_act": _SILU, "moe_layer_freq": _EVERY_LAYER,
         "scoring_func": (("sigmoid",), "the router scores experts with a sigmoid"),
         "topk_method": (("noaux_tc",), "group-limited routing with e_score_correction_bias"),
         "norm_topk_prob": ((True, False), ""), "rope_interleave": ((True, False), "")},
    V32: {"hidden_act": _SILU, "moe_layer_freq": _EVERY_LAYER,
          "scoring_func": (("sigmoid",), "the router scores experts with a sigmoid"),
          "topk_method": (("noaux_tc",), "group-limited routing with e_score_correction_bias"),
          "norm_topk_prob": ((True, False), ""),
          "index_k_norm_type": (("layer",), "the indexer's key norm is a LayerNorm"),
          # the reference ignores it (its MLPs never have biases)
          "mlp_bias": ((True, False, None), "")},
}
# Multi-token-prediction layers (checkpoint layers past num_hidden_layers) are not run by the
# reference either: the causal LM's loader skips them; `--speculative-algorithm NEXTN` loads
# them as the draft of a V3.2 (runner/models/deepseek_mtp.py), and IndexShare
# (index_share_for_mtp_iteration) is how that draft reuses its top-k.
_MTP = {"num_nextn_predict_layers", "index_share_for_mtp_iteration"}


def check_config(arch: str, raw: dict) -> None:
    """ValueError naming the first config.json field of `arch` that kvstrata does not build."""
    refuse_fields(arch, raw, _KNOWN | _MTP | (_DSA_FIELDS if arch == V32 else set()),
                  _FIXED[arch])
    if raw.get("num_key_value_heads", raw.get("num_attention_heads")) != raw.get(
            "num_attention_heads"):
        raise ValueError(f"{arch}: MLA needs num_key_value_heads == num_attention_heads")


@dataclass(frozen=True, kw_only=True)
class DeepseekDims(MoeDims):
    """MoeDims (the MoE block's routing and widths; scoring "softmax" and topk_method
    "greedy" / "group_limited_greedy" for V2) and the MLA model's own."""
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None      # None: one q_proj (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int | None    # the DSA indexer's (V3.2); None without one
    index_head_dim: int | None
    index_topk: int | None
    mlp_layer_types: tuple[str, ...]
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope_interleave: bool = True  # rope on interleaved pairs (False: halves, V3 option)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def uses_dsa(self) -> bool:
        return self.index_topk is not None

    @classmethod
    def from_config(cls, c: Any, arch: str = V32) -> "DeepseekDims":
        dsa = arch == V32
        if dsa and c.q_lora_rank is None:
            raise ValueError(f"{arch}: q_lora_rank is required (the indexer reads the q "
                             f"low-rank residual)")
        if dsa and c.index_head_dim < c.qk_rope_head_dim:
            raise ValueError(f"{arch}: index_head_dim < qk_rope_head_dim")
        layers = c.num_hidden_layers
        types = getattr(c, "mlp_layer_types", None) or (
            ["dense"] * min(c.first_k_dense_replace, layers)
            + ["sparse"] * max(0, layers - c.first_k_dense_replace))
        v2 = arch == V2
        method = (getattr(c, "topk_method", None) or "greedy") if v2 else "noaux_tc"
        grouped = method != "greedy"
        n_group = (c.n_group or 1) if grouped else 1
        if c.n_routed_experts % n_group:
            raise ValueError(f"{arch}: n_routed_experts must divide into n_group groups")
        return cls(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            moe_intermediate_size=c.moe_intermediate_size, num_layers=layers,
            num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
            index_n_heads=c.index_n_heads if dsa else None,
            index_head_dim=c.index_head_dim if dsa else None,
            index_topk=c.index_topk if dsa else None, n_routed_experts=c.n_routed_experts,
            n_shared_experts=c.n_shared_experts, num_experts_per_tok=c.num_experts_per_tok,
            n_group=n_group, topk_group=(c.topk_group or 1) if grouped else 1,
            norm_topk_prob=bool(c.norm_topk_prob) and not v2,
            routed_scaling_factor=float(c.routed_scaling_factor),
            mlp_layer_types=tuple(types), vocab_size=c.vocab_size,
            rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(c, "attention_bias", False)),
            scoring="softmax" if v2 else "sigmoid", topk_method=method,
            rope_interleave=v2 or dsa or bool(getattr(c, "rope_interleave", True)))
