"""Tiny random hybrid recurrent checkpoints (Qwen3.5, Qwen3-Next, Nemotron-H, Mamba2,
Granite-4.0-H) from transformers' own config classes, and a runner over them with a
hand-sized KV plan (state pool included).

Sizes keep every shape distinct (GVA 2 key heads : 4 value heads of other widths, GQA 4:2,
2 Mamba2 groups), a 3:1 recurrent:attention pattern, and scales where the logits are peaked.
No EOS token: transformers' generate would mask it until min_new_tokens where our greedy run
(ignore_eos) may pick it.
Gated DeltaNet's recurrent states hold ~1 long-lived direction per head at initializer_range
0.02, so the weights are drawn larger (GDN_INIT) for the state to matter to the logits.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from helpers.tiny_ckpt import build_checkpoint, hf_model

VOCAB = 160
HYBRIDS = ("qwen3_5", "qwen3_next", "nemotron_h", "mamba2", "granite")
ARCH_NAMES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
              "nemotron_h": "NemotronHForCausalLM", "mamba2": "Mamba2ForCausalLM",
              "granite": "GraniteMoeHybridForCausalLM"}


def tiny_hybrid_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, initializer_range=0.15,
                  bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    gdn = dict(intermediate_size=88, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
               linear_conv_kernel_dim=4, max_position_embeddings=512,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25})
    if arch == "qwen3_5":
        return tf.Qwen3_5TextConfig(**common, **gdn)
    if arch == "qwen3_next":
        return tf.Qwen3NextConfig(**common, **gdn, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                  decoder_sparse_step=2, mlp_only_layers=[])
    if arch == "nemotron_h":
        return tf.NemotronHConfig(**common, intermediate_size=88, num_hidden_layers=4,
                                  hybrid_override_pattern="M*M-", num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, mamba_num_heads=4,
                                  mamba_head_dim=8, ssm_state_size=16, n_groups=2,
                                  chunk_size=8, max_position_embeddings=512)
    if arch == "mamba2":
        return tf.Mamba2Config(**common, num_hidden_layers=2, num_heads=8, head_dim=16,
                               state_size=16, n_groups=2, chunk_size=8, expand=2)
    if arch == "granite":  # rope on and every multiplier away from 1, so each must apply
        return tf.GraniteMoeHybridConfig(
            **common, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "mamba"],
            mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2,
            mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=56, position_embedding_type="rope",
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
            logits_scaling=1.5, max_position_embeddings=512)
    raise ValueError(arch)


def _redraw(arch: str) -> Callable[[str, Any], None]:
    def redraw(name: str, p) -> None:
        if name.endswith("norm.weight") and arch in ("qwen3_5", "qwen3_next"):
            if "linear_attn" not in name:  # 1 + w norms: w of 0 would hide the + 1
                p.normal_(0, 0.3)
        elif name.endswith(("A_log",)):
            p.uniform_(-1.0, 1.0)  # decays from ~0.4 to ~0.95 a token: state matters
        elif name.endswith("dt_bias"):
            p.uniform_(-2.0, 0.5)
    return redraw


def build_hybrid_checkpoint(arch: str, path: str, seed: int = 2468, **overrides) -> str:
    """`overrides`: config fields set over the tiny config's (a variant of it)."""
    config = tiny_hybrid_config(arch)
    for field, value in overrides.items():
        setattr(config, field, value)
    return build_checkpoint(config, path, seed + HYBRIDS.index(arch), _redraw(arch))


def hybrid_checkpoints(root: str, archs=HYBRIDS) -> dict[str, str]:
    return {a: build_hybrid_checkpoint(a, os.path.join(root, a)) for a in archs}


hf_hybrid = hf_model


class HFGreedy:
    """transformers' greedy continuation per prompt of one checkpoint, computed once. An
    explicit all-ones attention mask: generate() would otherwise mask every token equal to
    the pad id (0) -- which a second turn built from an earlier output may contain -- and
    Mamba2's torch path zeroes masked tokens."""

    def __init__(self, path: str):
        self.model = hf_hybrid(path)
        self.cache: dict = {}

    def __call__(self, prompt: list[int], new: int) -> list[int]:
        import torch

        key = (tuple(prompt), new)
        if key not in self.cache:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                          do_sample=False, max_new_tokens=new,
                                          min_new_tokens=new, pad_token_id=0)
            self.cache[key] = out[0, len(prompt):].tolist()
        return self.cache[key]


def hf_logits(model, prompt: list[int]):
    import torch

    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def hybrid_runner(path: str, page_size: int = 1, num_pages: int = 2048, rows: int = 16,
                  state_slots: int = 24, context_len: int = 512, dtype: str = "float32",
                  ssm_dtype: str = "float32"):
    """A ModelRunner whose KV plan is sized here (the server's sizing of a state pool is the
    engine's): `num_pages` pages for the attention layers and `state_slots` state slots."""
    import dataclasses

    from kvstrata.config.kv_plan import KVPlan
    from kvstrata.runner.model_runner import ModelRunner

    runner = ModelRunner(path, dtype=dtype, device="cpu")
    facts = runner.kv_facts()
    states = tuple(dataclasses.replace(c, dtype=ssm_dtype) if c.name == "ssm" else c
                   for c in facts.state_components)
    runner.allocate_kv(KVPlan(page_size, num_pages, rows, context_len, facts.pool_kind,
                              facts.components, num_state_slots=state_slots,
                              state_components=states))
    return runner
