"""Tiny random MoE checkpoints from transformers' own config classes (helpers/tiny_ckpt.py
builds them): 2-3 layers, hidden 64, 8 experts, top-2, vocab 300.

Llama-family MoEs (moe_decoder.py), GQA 4:2: Qwen3-MoE with norm_topk_prob and a dense first
layer (mlp_only_layers), Qwen2-MoE with its gated shared expert and q/k/v biases (drawn, not
zero), Mixtral with a sliding window of 16 that the longer prompts cross, GLM-4.5 (Glm4Moe)
with q/k/v biases, q/k norms, rotary on half of each head, a dense first layer and V3's
grouped sigmoid router (4 groups, 2 kept, correction bias drawn).
MLA MoEs (deepseek.py), 3 layers (1 dense): DeepSeek-V3 with YaRN (mscale != mscale_all_dim)
and grouped routing; V2-Lite's shape (q_lora_rank None, greedy softmax top-k, YaRN); V2 with
group_limited_greedy and a q low-rank projection.
initializer_range 0.15 makes the router's choices clear (at 0.02 every token's top-2 would be
a near-tie).
"""
from __future__ import annotations

import os

from helpers.tiny_ckpt import build_checkpoint, hf_model, scale_outputs

VOCAB = 300
MIXTRAL_WINDOW = 16
MOES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
MLA_MOES = ("deepseek_v3", "deepseek_v2_lite", "deepseek_v2")
ARCH_NAMES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
              "mixtral": "MixtralForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
              "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2_lite": "DeepseekV2ForCausalLM",
              "deepseek_v2": "DeepseekV2ForCausalLM"}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.8, "mscale_all_dim": 1.0}


def tiny_moe_config(arch: str, **overrides):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                  max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    mla = {**common, **dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48,
                            moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=1,
                            first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8,
                            qk_nope_head_dim=12, v_head_dim=12), **overrides}
    llama = {**common, **overrides}  # a llama-family MoE: any field may be overridden
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**{**dict(head_dim=16, intermediate_size=88,
                                           moe_intermediate_size=40, num_experts=8,
                                           norm_topk_prob=True, mlp_only_layers=[0]), **llama})
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**{**dict(intermediate_size=88, moe_intermediate_size=40,
                                           shared_expert_intermediate_size=56, num_experts=8,
                                           norm_topk_prob=False), **llama})
    if arch == "mixtral":
        return tf.MixtralConfig(**{**dict(intermediate_size=40, num_local_experts=8,
                                          sliding_window=MIXTRAL_WINDOW), **llama})
    if arch == "glm4_moe":
        return tf.Glm4MoeConfig(**{**dict(intermediate_size=88, moe_intermediate_size=40,
                                          n_routed_experts=8, n_shared_experts=1, n_group=4,
                                          topk_group=2, first_k_dense_replace=1,
                                          routed_scaling_factor=2.5, norm_topk_prob=True,
                                          use_qk_norm=True, attention_bias=True,
                                          partial_rotary_factor=0.5), **llama})
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(**{**dict(q_lora_rank=24, n_group=4, topk_group=2,
                                             routed_scaling_factor=2.5, norm_topk_prob=True,
                                             rope_parameters=YARN), **mla})
    if arch == "deepseek_v2_lite":
        return tf.DeepseekV2Config(**{**dict(q_lora_rank=None, topk_method="greedy",
                                             routed_scaling_factor=1.0,
                                             rope_parameters=YARN), **mla})
    if arch == "deepseek_v2":
        return tf.DeepseekV2Config(**{**dict(q_lora_rank=24, n_group=4, topk_group=2,
                                             topk_method="group_limited_greedy",
                                             routed_scaling_factor=16.0), **mla})
    raise ValueError(arch)


def _redraw(name: str, t) -> None:
    if name.endswith("proj.bias"):
        t.normal_(0, 0.3)  # transformers initialises biases to 0: a dropped one hides
    elif name.endswith("norm.weight"):
        t.normal_(1, 0.3)
    elif name.endswith("e_score_correction_bias"):
        t.normal_(0, 0.3)  # zero-initialised too: make it change which experts are chosen


def build_moe_checkpoint(arch: str, path: str, seed: int = 1357, **overrides) -> str:
    archs = MOES + MLA_MOES
    return build_checkpoint(tiny_moe_config(arch, **overrides), path,
                            seed + archs.index(arch), _redraw)


def calm_moe_checkpoint(arch: str, path: str, seed: int = 2468) -> str:
    """The tiny config of `arch` drawn at initializer_range 0.05 (the calm tiny llama of
    test_w8a8_int8.py): at 0.15 the layers amplify int8's per-layer error to ~3% of the
    logits' range and half the greedy steps sit within it."""
    config = tiny_moe_config(arch)
    config.initializer_range = 0.05
    return build_checkpoint(config, path, seed + (MOES + MLA_MOES).index(arch), _redraw)


def add_v3_mtp_layer(src: str, dst: str, output_scale: float | None = None) -> str:
    """A copy of the tiny DeepSeek-V3 checkpoint `src` with one MTP layer, stored as
    DeepSeek's releases store it (kvstrata/bench/tiny_dsa.py's writer; no IndexShare flag:
    V3 has no indexer). `output_scale`: every layer's output projections (the MTP layer's
    too) scaled by it, and eh_proj passing the embedding half through, so most drafts pass
    (tiny_ckpt.scale_outputs); None keeps the random draft (few pass)."""
    import torch
    from safetensors.torch import load_file, save_file

    from kvstrata.bench.tiny_dsa import add_mtp_layer

    donor = tiny_moe_config("deepseek_v3")
    donor.num_hidden_layers += 1
    add_mtp_layer(src, dst, donor, index_share=None)
    if output_scale is None:
        return dst
    tensors = load_file(f"{dst}/model.safetensors")
    scale_outputs(tensors, output_scale)
    pre, h = f"model.layers.{donor.num_hidden_layers - 1}.", donor.hidden_size
    tensors[pre + "eh_proj.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1) + (
        torch.randn(h, 2 * h) * 0.02)
    tensors[pre + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return dst


def moe_checkpoints(root: str, archs=MOES) -> dict[str, str]:
    return {a: build_moe_checkpoint(a, os.path.join(root, a)) for a in archs}


hf_moe = hf_model
