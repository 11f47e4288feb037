"""The MoE fields of a Nemotron-H MoE GGUF file (llama.cpp arch `nemotron_h_moe`, written by
convert_hf_to_gguf.py's NemotronHModel for a checkpoint with experts: Nemotron-3 Nano /
Super), read as llama.cpp's nemotron_h hparams and its build_moe_ffn read them:

  expert_count / expert_used_count     n_routed_experts / num_experts_per_tok
  expert_feed_forward_length           moe_intermediate_size (else ffn_up_exps' rows)
  expert_shared_feed_forward_length    moe_shared_expert_intermediate_size (else
                                       ffn_up_shexp's rows)
  expert_shared_count                  n_shared_experts (transformers builds one shared MLP
                                       of that width whatever it says)
  expert_weights_norm                  norm_topk_prob (absent: false, llama.cpp's default)
  expert_weights_scale                 routed_scaling_factor (absent: 1, nothing applied)
  expert_group_count /                 n_group / topk_group (absent: one group; groups
  expert_group_used_count              without a used count are refused by key)
  moe_latent_size                      moe_latent_size (ffn_latent_down / _up present)
The router is the sigmoid one with the correction bias choosing only (exp_probs_b: llama.cpp's
nemotron_h graph hard-codes sigmoid gating), the experts relu^2 without a gate. Every layer
with a feed-forward length is a MoE (layer kinds: config/gguf_hybrid.py).
"""
from __future__ import annotations

from typing import Any

NEMOTRON_MOE_KEYS = ("expert_feed_forward_length", "expert_shared_feed_forward_length",
                     "expert_shared_count", "expert_weights_norm", "expert_weights_scale",
                     "expert_group_count", "expert_group_used_count", "moe_latent_size")


def nemotron_moe_fields(arch: str, get, need, layers: dict[str, Any],
                        dims: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """config.json's MoE fields of a nemotron_h_moe file (`layers`: its layer kinds and sizes
    as config/gguf_hybrid.py read them; `dims`: name -> ne)."""
    moe_layers = [i for i, kind in enumerate(layers["layers_block_type"]) if kind == "moe"]
    if not moe_layers:
        return {}
    first = moe_layers[0]
    up, shared = dims.get(f"blk.{first}.ffn_up_exps.weight"), dims.get(
        f"blk.{first}.ffn_up_shexp.weight")
    if up is None or shared is None:
        raise ValueError(f"GGUF {arch}: layer {first} has a feed-forward length but no "
                         f"ffn_up_exps / ffn_up_shexp (a nemotron_h_moe feed-forward layer "
                         f"is a MoE with a shared expert)")
    experts = int(need("expert_count"))
    groups = int(get("expert_group_count", 1) or 1)
    used_groups = get("expert_group_used_count")
    if groups > 1 and used_groups is None:
        raise ValueError(f"GGUF {arch}: {arch}.expert_group_count {groups} without "
                         f"{arch}.expert_group_used_count is not supported (which groups the "
                         f"router keeps is unknown)")
    latent = get("moe_latent_size")
    has_latent = f"blk.{first}.ffn_latent_down.weight" in dims
    if bool(latent) != has_latent:
        raise ValueError(f"GGUF {arch}: moe_latent_size {latent} and the ffn_latent_down "
                         f"tensors disagree")
    return {"n_routed_experts": experts, "num_experts_per_tok": int(need("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length") or up[1]),
            "moe_shared_expert_intermediate_size": int(
                get("expert_shared_feed_forward_length") or shared[1]),
            "n_shared_experts": int(get("expert_shared_count", 1) or 1),
            "norm_topk_prob": bool(get("expert_weights_norm", False)),
            "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
            "n_group": groups, "topk_group": int(used_groups or 1),
            "moe_latent_size": int(latent) if latent else None}


__all__ = ["NEMOTRON_MOE_KEYS", "nemotron_moe_fields"]
