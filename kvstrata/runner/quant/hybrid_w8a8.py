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

from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.runner.quant.w8a8 import (activation_bits, begin_quantization, quantized_linear,
                                        weight_bytes)

# Kept float: MoE routers (moe.py, moe_decoder.py, granite_hybrid.py, nemotron_h_moe.py) and
# Qwen's shared-expert gate (module docstring)
FLOAT_WEIGHTS = ("router", "shared_gate")


def int8_or_float_linear(x: torch.Tensor, weight: Any,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for F.linear once quantize_hybrid_model ran: an int8 layer (its bias folded
    in), or a weight kept float (FLOAT_WEIGHTS)."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return quantized_linear(x, weight)


def _names(entry: str | tuple[str, str]) -> tuple[str, str | None]:
    return (entry, None) if isinstance(entry, str) else entry


def _swap(owner: nn.Module, name: str, value: Any) -> None:
    delattr(owner, name)  # a Module cannot be assigned over a Parameter
    setattr(owner, name, value)


def _quantize_block(block: nn.Module, layer_cls: Callable[..., nn.Module]) -> int:
    """The block's named weights (and its children's) as int8 layers, in place; returns how
    many (a stack counts its experts)."""
    count = 0
    for entry in block.pinned_weights:
        name, bias_name = _names(entry)
        weight = getattr(block, name)
        if weight is None or name in FLOAT_WEIGHTS:
            continue
        bias = getattr(block, bias_name) if bias_name else None
        _swap(block, name, layer_cls(weight, bias))
        if bias is not None:
            _swap(block, bias_name, None)
        count += 1
    for entry in block.pinned_expert_stacks:
        name, bias_name = _names(entry)
        stack = getattr(block, name)
        biases = getattr(block, bias_name) if bias_name else None
        _swap(block, name, nn.ModuleList(  # experts[e] as stack[e] was
            layer_cls(stack[e], None if biases is None else biases[e])
            for e in range(stack.shape[0])))
        if biases is not None:
            _swap(block, bias_name, None)
        count += stack.shape[0]
    for name in getattr(block, "pinned_children", ()):
        child = getattr(block, name)
        if child is not None:
            count += _quantize_block(child, layer_cls)
    block.linear = int8_or_float_linear
    return count


def quantize_hybrid_model(model: Any, method: str, blocks: Iterable[nn.Module]) -> dict:
    """Replace a loaded hybrid model's linear weights (those `blocks` name, and the output
    head) by int8 layers in place (module docstring); returns what ran (for /server_info, as
    w8a8.quantize_model's)."""
    before, layer_cls, kernel = begin_quantization(model, method)
    count = sum(_quantize_block(block, layer_cls) for block in blocks)
    tied = model.lm_head is model.embed
    _swap(model, "lm_head", layer_cls(model.lm_head))  # tied: the embedding stays float
    model.linear = int8_or_float_linear
    return {"quantization": method, "kernel": kernel, "activation_bits": activation_bits(model),
            "smoothing": "none", "int8_layers": count + 1,
            "weight_bytes_float": before, "weight_bytes": weight_bytes(model),
            "tied_output_projection_copy": tied}


__all__ = ["FLOAT_WEIGHTS", "int8_or_float_linear", "quantize_hybrid_model"]
