"""DeepSeek-V2 / V3 / V3.2 (MLA) on kvstrata's packed linears (runner/cpu/packed_linear.py):
what the llama-family decoder got from packed_linear.pack_model, for every matmul of an MLA
model -- packed for serving (kvstrata's bf16 GEMM on AVX512-BF16 / AMX, oneDNN's prepacked
layout for fp32 and widths the GEMM does not take), or fixed (deterministic inference:
deepseek_fixed.py adds its rotary table).

Why: unpacked, every projection and each MoE expert's slice ran torch's F.linear on a plain
bf16 weight, and the same tiny V3 served 2-3.8x faster with --enable-deterministic-inference,
which packs them all (docs/benchmarks.md, "Deterministic inference on MLA / DSA").

What is packed (a model's attributes are replaced in place, as pack_model does):
  - the latent and query projections (q_proj or q_a / q_b, kv_a), o_proj, the indexer's wq_b,
    wk and float32 weights_proj, and the output head: pack_model over
    DeepseekForCausalLM.packed_linears;
  - kv_b_proj's halves, which the absorbed attention applies per head: serving keeps each
    half as one contiguous stack for one torch.bmm over the heads (key [H, nope, R], value
    transposed [H, R, v]) -- the einsum over kv_b_proj's strided view copied the weights on
    every call, and one layer per head on kvstrata's GEMM paid a Python call per head (8
    heads, nope 64, R 128, v 64, bf16, one thread, alternated: bmm 24-28 us against the
    einsum's 39-68 at 1-16 rows, 70-75 against 101-138 at 256; the per-head loop was slower
    than both in a first, noisier run); deterministic inference one fixed GEMM per head (a
    batched matmul blocks by the token count). Beside the plain kv_b_proj (kept: the weight
    map names it);
  - every layer's FFN: the dense SwiGLU of the first layers and the MoE blocks (router, each
    routed expert, the shared experts: fixed_experts.pack_block, the same code that pins the
    llama-family MoE blocks).
The decode plan (decode_plan.py) replays the llama-family decoder only; an MLA model runs its
layer loop. --quantization w8a8_int8 packs the same way with int8 projections and experts
(runner/models/deepseek_w8a8.py).
Measured (benchmarks/ab_deepseek_packed.py, docs/benchmarks.md "DeepSeek on packed linears"):
batch 1 1.4-1.55x the unpacked path's speed at bf16.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from kvstrata.runner.cpu.fixed_experts import pack_block
from kvstrata.runner.cpu.packed_linear import PackedLinear, pack_model, replace_weight


def pack_mla_model(model: Any, fixed: bool = False) -> dict:
    """Pack a loaded DeepseekForCausalLM in place (module docstring); returns what ran (for
    /server_info, as pack_model's)."""
    info = pack_model(model, fixed=fixed)
    moe_layers = sum(pack_mla_ffn_and_heads(layer, model.dims, fixed) for layer in model.layers)
    key = "pinned" if fixed else "packed"
    return {**info, f"{key}_moe_layers": moe_layers,
            f"{key}_absorbed_heads": model.dims.num_heads}


def pack_mla_ffn_and_heads(layer: Any, dims: Any, fixed: bool = False) -> bool:
    """A DeepseekLayer's absorbed kv_b heads and its FFN (dense or MoE) packed in place;
    returns whether the FFN is an MoE block. (Its 2-D projections: pack_model, or
    pack_mla_layer for a layer outside model.layers.)"""
    pack_absorbed_heads(layer, dims, fixed)
    pack_block(layer.mlp, fixed)
    return hasattr(layer.mlp, "router")


def pack_absorbed_heads(layer: Any, dims: Any, fixed: bool = False) -> None:
    """kv_b_proj's halves as the absorbed attention applies them (module docstring)."""
    key_half, value_half = layer.absorbed(dims)  # [H, nope, R], [H, v, R]
    if fixed:  # one fixed GEMM per head: a batched matmul blocks by the token count
        layer.key_heads = nn.ModuleList(PackedLinear(key_half[h].t().contiguous(), fixed=True)
                                        for h in range(dims.num_heads))
        layer.value_heads = nn.ModuleList(PackedLinear(value_half[h].contiguous(), fixed=True)
                                          for h in range(dims.num_heads))
    else:
        layer.key_stack = key_half.contiguous()
        layer.value_stack = value_half.transpose(1, 2).contiguous()


def pack_mla_layer(layer: Any, dims: Any, linears: tuple) -> None:
    """Every matmul of one DeepseekLayer outside a model's `layers` (an MTP draft's layer,
    deepseek_mtp.py), packed for serving: `linears` is DeepseekForCausalLM.packed_linears."""
    for weight_name, bias_name in linears:
        if getattr(layer, weight_name) is not None:
            replace_weight(layer, weight_name, bias_name)
    pack_mla_ffn_and_heads(layer, dims)
