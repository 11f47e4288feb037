"""`--quantization w8a8_int8` on DeepSeek-V2 / V3 / V3.2 (MLA: runner/models/deepseek.py): the
dense path's scheme (runner/quant/w8a8.py: int8 weights with one scale per output channel,
int8 activations with one scale per token) wherever the model multiplies by a plain 2-D
weight, applied once after the weights load.

int8: the query and latent projections (q_proj, or q_a_proj / q_b_proj; kv_a_proj), o_proj,
the output head, the dense SwiGLU of the first layers, every routed expert (its own int8
layer: tokens grouped by expert run that expert's int8 GEMM, moe.routed_sum) and the shared
experts.
Float (packed as the float model packs them, deepseek_packed.py):
  - the router and V3's correction bias (w8a8.ROUTING_WEIGHTS: its logits choose experts);
  - V3.2's DSA indexer (wq_b, wk, weights_proj, float32 in the reference): its scores choose
    which keys each query attends, a discrete choice like the router's;
  - kv_b_proj's absorbed halves, applied per head as two batched matmuls over [H, nope, R]
    and [H, R, v] stacks. int8 there does not hurt accuracy: emulated on the tiny V3 of
    tests/correctness/test_w8a8_moe.py (each head's output channels scaled over the
    contraction, activations per token and head, float32, 6 prompts of 7-80 tokens), the
    logit error against float32 went median 0.0275 -> 0.0281, p90 0.0388 -> 0.0390. They stay
    float for speed: an int8 layer per head pays one call and one row quantisation per
    head per layer (the per-head loop of packed layers was already slower than one bmm,
    deepseek_packed.py), for a small share of the bytes (V3: 2 x 128 x 128 x 512 per layer
    against 256 experts of 3 x 7168 x 2048).
Not smoothed (runner/quant/smoothing.py is built for the llama decoder's norms and weights;
the calibration forward would need MLA's attention here).
With --enable-deterministic-inference the float parts go on kvstrata's fixed GEMM, the
absorbed halves one fixed GEMM per head, and the rotary table in fixed blocks, as
deepseek_fixed.py pins a float model; the int8 GEMM is batch-invariant as it stands.
"""
from __future__ import annotations

from typing import Any

from kvstrata.runner.cpu.packed_linear import replace_weight
from kvstrata.runner.models.deepseek_fixed import BlockedCosSin
from kvstrata.runner.models.deepseek_packed import pack_absorbed_heads
from kvstrata.runner.quant.w8a8 import (activation_bits, check_method, float_packing,
                                        int8_kernel, mixed_linear, quantize_experts,
                                        quantize_head, replace_with_int8, weight_bytes)

# DeepseekForCausalLM.packed_linears' weights that stay float (the module docstring)
FLOAT_PROJECTIONS = ("index_wq_b", "index_wk", "index_weights_proj")


def quantize_mla_model(model: Any, method: str, fixed: bool = False) -> dict:
    """Quantize a loaded DeepseekForCausalLM in place (module docstring); returns what ran
    (for /server_info)."""
    check_method(model, method)
    before = weight_bytes(model)
    layer_cls, kernel = int8_kernel()
    pack_float = fixed or float_packing(model)
    moe_layers = 0
    for layer in model.layers:
        for weight_name, bias_name in model.packed_linears:
            if getattr(layer, weight_name) is None:  # absent (V2-Lite's q_a / q_b, no DSA)
                continue
            if weight_name not in FLOAT_PROJECTIONS:
                replace_with_int8(layer, weight_name, bias_name, layer_cls)
            elif pack_float:
                replace_weight(layer, weight_name, bias_name, fixed=fixed)
        if pack_float:
            pack_absorbed_heads(layer, model.dims, fixed)
        quantize_experts(layer.mlp, layer_cls, fixed, pack_float)
        moe_layers += hasattr(layer.mlp, "router")
    info = quantize_head(model, layer_cls)
    model.linear = mixed_linear
    if fixed:
        model.fixed_rope = BlockedCosSin(model.rotary.plain_cos_sin)
    return {"quantization": method, "kernel": kernel, **activation_bits(model),
            "smoothing": "none: not built for MLA models (runner/models/deepseek_w8a8.py)",
            "int8_moe_layers": moe_layers,
            "float_absorbed_heads": model.dims.num_heads,
            "weight_bytes_float": before, "weight_bytes": weight_bytes(model), **info}
