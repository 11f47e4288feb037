"""`--quantization w8a8_int8` for the recurrent hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next,
Nemotron-H and its MoE, Granite-4.0-H, Falcon-H1, Mamba2): the dense path's scheme
(runner/quant/w8a8.py: int8 weights with one symmetric scale per output channel, int8
activations with one scale per token, on the int8 layer this CPU runs: int8_kernel) on
their projections. The recurrent kernels (conv, scan), norms, activations and the state pool
stay float.

Which weights: every one a block names for the packed / pinned paths (the blocks
runner/models/hybrid_packed.weight_blocks yields, which model_setup.py passes in: attention's q|k|v and o_proj, Gated DeltaNet's and Mamba2's in_proj /
out_proj, the MLPs, each routed expert, shared experts, Nemotron-H's latent projections) and
the output head (a tied one gets an int8 copy; the lookup keeps the float embedding).
The MoE routers and Qwen's shared-expert gate stay float (FLOAT_WEIGHTS): a router's few
outputs choose the experts, where an int8 rounding would flip a near tie and route a token
elsewhere, and they are a sliver of the weights.

Not done here (the dense path does it, runner/quant/smoothing.py): SmoothQuant's outlier
migration, which folds per-channel scales into the norm before each linear -- the hybrids'
norms differ per family (Gemma-style 1 + w, gated group norms before out_proj, Falcon-H1's
multipliers between norm and in_proj), so their activations are quantized as they come
(`smoothing: none`).
"""
from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from kvstrata.runner.quant.w8a8 import (ROUTING_WEIGHTS, activation_bits, check_method,
                                        int8_kernel, mixed_linear, quantize_experts,
                                        quantize_head, weight_bytes)

# Kept float: MoE routers and Qwen's shared-expert gate (w8a8.ROUTING_WEIGHTS, module docstring)
FLOAT_WEIGHTS = ROUTING_WEIGHTS


def quantize_hybrid_model(model: Any, method: str, blocks: Iterable[nn.Module]) -> dict:
    """Replace a loaded hybrid model's linear weights (those `blocks` name, and the output
    head) by int8 layers in place (module docstring; each block through
    w8a8.quantize_experts, the MoE decoders' path: its named weights, expert stacks and
    children); returns what ran (for /server_info, as w8a8.quantize_model's)."""
    check_method(model, method)
    before = weight_bytes(model)
    layer_cls, kernel = int8_kernel()
    # the routers stay plain float tensors (a few KiB; their block applies them by F.linear)
    count = sum(quantize_experts(block, layer_cls, False, False) for block in blocks)
    info = quantize_head(model, layer_cls)  # tied: the embedding stays float for the lookup
    model.linear = mixed_linear
    return {"quantization": method, "kernel": kernel, **activation_bits(model),
            "smoothing": "none", "int8_layers": count + 1,
            "weight_bytes_float": before, "weight_bytes": weight_bytes(model), **info}


__all__ = ["FLOAT_WEIGHTS", "quantize_hybrid_model"]
