"""The attention / MLP fields of a Falcon-H1 GGUF file (llama.cpp arch `falcon-h1`, written by
convert_hf_to_gguf.py's FalconH1Model), read as llama.cpp's falcon_h1 hparams and graph read
them (the Mamba2 fields: config/gguf_hybrid.py):

  attention.head_count / _kv      num_attention_heads / num_key_value_heads (one value)
  attention.key_length            head_dim (value_length must equal it)
  feed_forward_length             intermediate_size (SwiGLU MLP in every layer)
  rope.freq_base                  rope_theta (NEOX rope over the whole head: llama.cpp's
                                  rope type for the arch; q / k are stored unpermuted)
  context_length                  max_position_embeddings (config/gguf_hybrid.py)
The converter folds every muP multiplier into the weights (embedding_multiplier into
token_embd, lm_head_multiplier into output, attention_in into q / k / v, key_multiplier into
k, attention_out into attn_output, ssm_in and the five ssm_multipliers into ssm_in's row
blocks, ssm_out into ssm_out, mlp_multipliers into ffn_gate / ffn_down) and writes none of
them; llama.cpp applies none. So every multiplier is 1 here and the weights are the file's:
the same function (a product of linear maps; silu(gate * m) reads gate's rows scaled by m).
The mixer's gated norm: ssm_norm present means mamba_rms_norm, applied after the gate
(llama.cpp's build_mamba2_layer: y * silu(z), then the grouped RMS norm), so
mamba_norm_before_gate is false; without ssm_norm only the gate. Refused by name: biases
llama.cpp's falcon-h1 does not read or kvstrata's model refuses (ssm_in.bias, ssm_out.bias,
attention and MLP biases), rope scaling, a partial rope.
"""
from __future__ import annotations

from typing import Any

_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train default
# tensors a falcon-h1 file may not hold here: the converter cannot write ssm_in's bias (its
# ssm_multipliers fold indexes rows of a matrix), llama.cpp reads no ssm_out bias, and
# FalconH1ForCausalLM refuses attention_bias / mlp_bias
_REFUSED_BIASES = ("ssm_in.bias", "ssm_out.bias", "attn_q.bias", "attn_k.bias", "attn_v.bias",
                   "attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")


def falcon_h1_fields(arch: str, get, need, n_layer: int, n_embd: int,
                     dims: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    biases = sorted({name.split(".", 2)[2] for name in dims
                     if name.startswith("blk.") and name.endswith(_REFUSED_BIASES)})
    if biases:
        raise ValueError(f"GGUF {arch}: {', '.join(biases)} is not supported (llama.cpp's "
                         f"falcon-h1 reads no such bias, or FalconH1ForCausalLM refuses it)")
    heads, n_kv = need("attention.head_count"), need("attention.head_count_kv")
    if isinstance(heads, list) or isinstance(n_kv, list):
        raise ValueError(f"GGUF {arch}: a head count per layer is not supported (every "
                         f"falcon-h1 layer has attention)")
    head_dim = int(get("attention.key_length", n_embd // int(heads)))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"GGUF {arch}: attention.value_length != key_length is not "
                         f"supported")
    scaling = get("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF {arch}: rope.scaling.type {scaling!r} is not supported")
    rot = int(get("rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"GGUF {arch}: rope.dimension_count {rot} (a rope over part of the "
                         f"head of {head_dim}) is not supported")
    if get("attention.scale"):
        raise ValueError(f"GGUF {arch}: attention.scale is not supported (the converter "
                         f"folds the key multiplier into attn_k)")
    return {"num_attention_heads": int(heads), "num_key_value_heads": int(n_kv),
            "head_dim": head_dim, "intermediate_size": int(need("feed_forward_length")),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "projectors_bias": False, "mamba_rms_norm": any(
                n.endswith("ssm_norm.weight") for n in dims),
            "mamba_norm_before_gate": False,
            "rope_parameters": {"rope_type": "default",
                                "rope_theta": float(get("rope.freq_base", _ROPE_BASE))},
            "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "key_multiplier": 1.0,
            "attention_in_multiplier": 1.0, "attention_out_multiplier": 1.0,
            "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0,
            "ssm_multipliers": [1.0] * 5, "mlp_multipliers": [1.0, 1.0]}


__all__ = ["falcon_h1_fields"]
