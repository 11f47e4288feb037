"""Tiny random gpt-oss checkpoints (transformers' GptOssConfig) and an MXFP4 copy of one.

Random init leaves several gpt-oss parameters at zero (expert and router biases in places)
and the sinks small; the builder draws them all so a dropped bias or sink fails a test. The
SwiGLU limit is lowered (7 -> 1.5) so its clamps cut real activations of this tiny model.
Attention is eager (what transformers runs gpt-oss with on CPU; sdpa has no sinks).
"""
from __future__ import annotations

import torch

VOCAB = 300
WINDOW = 8


def tiny_config(**over):
    from transformers import GptOssConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
              max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-5,
              swiglu_limit=1.5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": 64})
    kw.update(over)
    return GptOssConfig(**kw)


def randomize(model, seed: int = 0) -> None:
    """Every bias, the router and the sinks drawn at a scale where they matter."""
    g = torch.Generator().manual_seed(seed)

    def draw(p: torch.Tensor, std: float) -> None:
        p.copy_(torch.randn(p.shape, generator=g) * std)

    with torch.no_grad():
        draw(model.model.norm.weight, 0.3)
        model.model.norm.weight.add_(1)
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            draw(attn.sinks, 1.0)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                draw(proj.bias, 0.3)
            draw(mlp.router.weight, 0.3)
            draw(mlp.router.bias, 0.5)
            draw(mlp.experts.gate_up_proj_bias, 0.5)
            draw(mlp.experts.down_proj_bias, 0.3)
            draw(layer.input_layernorm.weight, 0.3)
            layer.input_layernorm.weight.add_(1)
            draw(layer.post_attention_layernorm.weight, 0.3)
            layer.post_attention_layernorm.weight.add_(1)


def build_checkpoint(path: str, seed: int = 0, **over) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(**over)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_reference(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                attn_implementation="eager").eval()
