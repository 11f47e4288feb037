"""Tiny random hybrid recurrent checkpoints (Qwen3.5, Qwen3-Next, Nemotron-H, Mamba2,
Granite-4.0-H; Falcon-H1 apart: tiny_falcon_h1_config) from transformers' own config classes,
and a runner over them with a hand-sized KV plan (state pool included).

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
                  ssm_dtype: str = "float32", quantization: str | None = None):
    """A ModelRunner whose KV plan is sized here (the server's sizing of a state pool is the
    engine's): `num_pages` pages for the attention layers and `state_slots` state slots."""
    import dataclasses

    from kvstrata.config.kv_plan import KVPlan
    from kvstrata.runner.model_runner import ModelRunner

    runner = ModelRunner(path, dtype=dtype, device="cpu", quantization=quantization)
    facts = runner.kv_facts()
    states = tuple(dataclasses.replace(c, dtype=ssm_dtype) if c.name == "ssm" else c
                   for c in facts.state_components)
    runner.allocate_kv(KVPlan(page_size, num_pages, rows, context_len, facts.pool_kind,
                              facts.components, num_state_slots=state_slots,
                              state_components=states))
    return runner


def tiny_falcon_h1_config(**overrides):
    """Falcon-H1 with every muP multiplier away from 1 (each must apply where transformers
    applies it), a head_dim that is not hidden / heads, GQA 4:2, 2 Mamba2 groups, the gated
    group norm before the gate and the mixer's biases on (`overrides` turn them off)."""
    import transformers as tf

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=88, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                  initializer_range=0.15, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                  tie_word_embeddings=False, max_position_embeddings=512,
                  mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
                  mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8, mamba_rms_norm=True,
                  mamba_norm_before_gate=True, mamba_proj_bias=True, projectors_bias=True,
                  embedding_multiplier=2.0, lm_head_multiplier=0.7, key_multiplier=0.6,
                  attention_in_multiplier=1.3, attention_out_multiplier=0.8,
                  ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
                  ssm_multipliers=[1.1, 0.9, 1.3, 0.7, 1.5], mlp_multipliers=[1.2, 0.8],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return tf.FalconH1Config(**{**fields, **overrides})


def _falcon_redraw(name: str, p) -> None:
    if name.endswith(("A_log", "dt_bias")):
        _redraw("falcon_h1")(name, p)
    elif name.endswith((".D", "norm.weight", "layernorm.weight")):
        p.normal_(1.0, 0.3)  # a norm of ones or a skip of one would hide a dropped one
    elif name.endswith(".bias"):
        p.normal_(0.0, 0.1)


def build_falcon_h1_checkpoint(path: str, seed: int = 1357, **overrides) -> str:
    return build_checkpoint(tiny_falcon_h1_config(**overrides), path, seed, _falcon_redraw)


def tiny_nemotron_h_moe_config(**overrides):
    """Nemotron-H with MoE blocks (pattern M E * M E): 8 relu^2 experts in 2 groups of which
    the router keeps 1, top-2, a correction bias and routed_scaling_factor away from 1."""
    import transformers as tf

    fields = dict(vocab_size=VOCAB, hidden_size=64, initializer_range=0.15, bos_token_id=1,
                  eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
                  intermediate_size=88, hybrid_override_pattern="ME*ME", num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=8,
                  ssm_state_size=16, n_groups=2, chunk_size=8, max_position_embeddings=512,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                  moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1,
                  norm_topk_prob=True, routed_scaling_factor=1.5)
    return tf.NemotronHConfig(**{**fields, **overrides})


def _nemotron_moe_redraw(name: str, p) -> None:
    if name.endswith("e_score_correction_bias"):
        p.normal_(0.0, 0.3)  # a zero bias would hide a router that ignores it
    elif name.endswith("gate.weight"):
        p.normal_(0.0, 0.3)
    elif name.endswith(("A_log", "dt_bias")):
        _redraw("nemotron_h")(name, p)


def build_nemotron_h_moe_checkpoint(path: str, seed: int = 4242, **overrides) -> str:
    return build_checkpoint(tiny_nemotron_h_moe_config(**overrides), path, seed,
                            _nemotron_moe_redraw)


def build_qwen3_5_moe_checkpoint(path: str, seed: int = 3579) -> str:
    """Qwen3.5-MoE: the tiny Qwen3.5's shapes with 4 experts (top-2) and a shared expert in
    every layer; transformers saves the experts fused."""
    import transformers as tf

    dense = tiny_hybrid_config("qwen3_5").to_dict()
    fields = {k: dense[k] for k in (
        "vocab_size", "hidden_size", "initializer_range", "bos_token_id", "eos_token_id",
        "pad_token_id", "tie_word_embeddings", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
        "max_position_embeddings", "rope_parameters")}
    config = tf.Qwen3_5MoeTextConfig(**fields, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=24,
                                     shared_expert_intermediate_size=40)
    return build_checkpoint(config, path, seed, _redraw("qwen3_5"))


def assert_drained_whole(llm) -> None:
    """After a run: no request left, every pool whole, and every state slot free or holding
    a snapshot the prefix cache keeps."""
    sched = llm.engine.scheduler
    assert not sched.live_requests() and not sched.waiting
    llm.check_integrity()
    states = sched.kv.states
    assert states.allocator.available_pages() + states.tree.cached_states() == states.num_slots
