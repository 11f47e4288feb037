"""Tiny random Gemma 3 (text) and Gemma 2 checkpoints from transformers' own config classes,
and transformers' eager reference outputs for them.

Sizes as tests/conftest.py's tiny models (odd MLP width, GQA 4:2), with what Gemma adds made
to matter: a window of 8 so that prompts cross it, 6 layers so that Gemma 3's one global layer
follows five local ones, query_pre_attn_scalar (24) != head_dim (16) so that a default
1/sqrt(head_dim) scale fails, a scaled global rope (linear, factor 2) unlike the local one,
norm weights drawn at random (transformers initialises them to 0, where 1 + w = 1 would hide
the + 1), and Gemma 2's soft-caps small enough to bend the logits.
"""
from __future__ import annotations

import os

WINDOW = 8
VOCAB = 300
GEMMAS = ("gemma3", "gemma2")


def tiny_gemma_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=88,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=WINDOW,
                  query_pre_attn_scalar=24, tie_word_embeddings=True)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**common, num_hidden_layers=6, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})
    if arch == "gemma2":
        return tf.Gemma2Config(**common, num_hidden_layers=4, attn_logit_softcapping=3.0,
                               final_logit_softcapping=15.0,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(arch)


def build_gemma_checkpoint(arch: str, path: str, seed: int = 4321, config=None) -> str:
    """`config`: another config of `arch` (default: tiny_gemma_config's)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed + GEMMAS.index(arch))
    model = AutoModelForCausalLM.from_config(config or tiny_gemma_config(arch),
                                             dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)  # Gemma scales by 1 + w: a w of 0 would hide the + 1
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_gemma(path: str, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype or torch.float32, attn_implementation="eager").eval()


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list:
    """(tokens, per-step logits) per prompt: transformers' greedy generate."""
    import torch

    refs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        refs.append((out.sequences[0, len(prompt):].tolist(), [s[0] for s in out.logits]))
    return refs


def gemma_checkpoints(root: str) -> dict[str, str]:
    return {a: build_gemma_checkpoint(a, os.path.join(root, a)) for a in GEMMAS}
