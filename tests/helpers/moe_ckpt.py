"""Tiny random MoE checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral) from transformers' own config
classes: 2 layers, hidden 64, 8 experts, top-2, GQA 4:2, vocab 300.

What each family adds is made to matter: Qwen3-MoE with norm_topk_prob and a dense first
layer (mlp_only_layers), Qwen2-MoE with its gated shared expert and q/k/v biases (drawn, not
zero), Mixtral with a sliding window of 16 that the longer prompts cross. initializer_range
0.15 makes the router's choices clear (at 0.02 every token's top-2 would be a near-tie).
"""
from __future__ import annotations

import os

VOCAB = 300
MIXTRAL_WINDOW = 16
MOES = ("qwen3_moe", "qwen2_moe", "mixtral")
ARCH_NAMES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
              "mixtral": "MixtralForCausalLM"}


def tiny_moe_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                  max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=88,
                                 moe_intermediate_size=40, num_experts=8, norm_topk_prob=True,
                                 mlp_only_layers=[0])
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, intermediate_size=88, moe_intermediate_size=40,
                                 shared_expert_intermediate_size=56, num_experts=8,
                                 norm_topk_prob=False)
    if arch == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=40, num_local_experts=8,
                                sliding_window=MIXTRAL_WINDOW)
    raise ValueError(arch)


def build_moe_checkpoint(arch: str, path: str, seed: int = 1357) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed + MOES.index(arch))
    model = AutoModelForCausalLM.from_config(tiny_moe_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0, 0.3)  # transformers initialises biases to 0: a dropped one hides
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


def moe_checkpoints(root: str) -> dict[str, str]:
    return {a: build_moe_checkpoint(a, os.path.join(root, a)) for a in MOES}


def hf_moe(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()
