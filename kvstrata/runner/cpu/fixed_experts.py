"""MoE layers on kvstrata's packed linears: the router, every routed expert's projections and
the shared experts as PackedLinears -- on the fixed GEMM for deterministic inference
(packed_linear.PackedLinear._init_fixed: pin_block, pin_moe_layers), or packed for serving
(pack_block: kvstrata's bf16 GEMM / oneDNN's layout, as the dense layers; DeepSeek's MoE and
dense MLPs through runner/models/deepseek_packed.py, the llama-family MoEs' and gpt-oss'
blocks through pack_moe_layers).

Why: an expert's matmul runs over however many tokens the router sends it this step, and
torch's F.linear (oneDNN / MKL) picks its body -- and so a row's summation order -- by the
row count, so a token's bits depended on which other tokens chose its experts. The fixed GEMM
sums each output over k in one order for any row count. The combine then sums each token's
k weighted expert outputs in slot order (the token's own top-k order, never the batch's
expert order), in float32, rounded once (moe.routed_sum, `ordered`); a sigmoid (GLM-4.5's
router, Qwen2-MoE's shared-expert gate) runs per row (moe.row_sigmoid: torch's elementwise
sigmoid rounds an element by its place in the flattened tensor), and silu(gate) * up per row
(moe.swiglu).

A MoE block names what it pins (the runner/models/moe.py and moe_decoder.py blocks, a
gpt-oss layer): `pinned_weights` (2-D [out, in] weights: the router, a shared expert's gate),
`pinned_expert_stacks` (3-D [experts, out, in] stacks: each expert becomes one fixed
PackedLinear, indexed as the stack was) and `pinned_children` (sub-blocks: a shared SwiGLU).
An entry is a weight's attribute name, or (weight, bias) names: the bias ([out], or
[experts, out] beside a stack) goes into the PackedLinear and its attribute becomes None.
After pinning the block calls `self.linear` (packed_linear) instead of F.linear and sets
`batch_invariant` (its per-row sigmoid and ordered combine). A block of a GGUF file kept
packed (--quantization gguf) keeps its packed weights (runner/quant/gguf_pinned.py pins only
its float ones, through pin_block, and its `linear` runs both kinds).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from kvstrata.runner.cpu.packed_linear import PackedLinear, packed_linear


def moe_blocks(model: Any) -> list[nn.Module]:
    """A loaded model's MoE blocks: each layer's `layer.moe`, or a layer that names its own
    expert stacks (gpt-oss)."""
    return [layer.moe if getattr(layer, "moe", None) is not None else layer
            for layer in model.layers
            if getattr(layer, "moe", None) is not None
            or hasattr(layer, "pinned_expert_stacks")]


def pin_moe_layers(model: Any) -> int:
    """Pin every MoE block of a loaded model (moe_blocks) in place; returns how many blocks
    were pinned (0 for a dense model)."""
    blocks = moe_blocks(model)
    for block in blocks:
        pin_block(block)
    return len(blocks)


def pack_moe_layers(model: Any) -> int:
    """Every MoE block of a loaded model (moe_blocks) on the serving PackedLinears
    (pack_block): the llama-family MoEs and gpt-oss unflagged, beside pack_model's attention
    layers. Returns how many blocks were packed (0 for a dense model)."""
    blocks = moe_blocks(model)
    for block in blocks:
        pack_block(block)
    return len(blocks)


def pin_block(block: nn.Module, linear: Callable = packed_linear) -> int:
    """Replace the block's float weights by fixed PackedLinears (see the module docstring);
    the block then applies its weights with `linear`. A weight kept in GGUF blocks (a
    GgufLinear, or a stack of them: a GGUF file kept packed) stays: its kernels are
    batch-invariant already, and runner/quant/gguf_pinned.py passes a `linear` that runs
    both. Returns how many float weights were pinned (a stack counts its experts)."""
    if not hasattr(block, "pinned_weights"):
        raise ValueError(f"--enable-deterministic-inference: {type(block).__name__} does not "
                         f"name its linear weights for the batch-invariant GEMM")
    return pack_block(block, fixed=True, linear=linear)


# make_layer(name, weight, bias, fixed, expert) -> the layer that replaces `weight` (`name`:
# its attribute; `expert`: one expert of a stack)
LayerMaker = Callable[[str, torch.Tensor, "torch.Tensor | None", bool, bool], nn.Module]


def packed_layer(name: str, weight: torch.Tensor, bias: torch.Tensor | None, fixed: bool,
                 expert: bool) -> PackedLinear:
    """pack_block's default: a PackedLinear. An expert's layer keeps one layout (never
    oneDNN's beside kvstrata's bf16 GEMM, packed_linear.split_layouts): the experts are most
    of a MoE model's weights, and a second copy of each would double them."""
    return PackedLinear(weight, bias, fixed=fixed, split=not expert)


def pack_block(block: nn.Module, fixed: bool = False, linear: Callable = packed_linear,
               make_layer: LayerMaker = packed_layer) -> int:
    """Replace the float weights the block names (module docstring) by `make_layer`'s layers
    (PackedLinears; --quantization w8a8_int8: int8 experts, runner/quant/w8a8.py): fixed
    ones (deterministic inference: then the block's per-row sigmoid and ordered combine too),
    or the serving ones; weights kept packed stay. Returns how many float weights were
    replaced (a stack counts its experts)."""
    replaced = 0
    for entry in block.pinned_weights:
        name, bias_name = _names(entry)
        weight = getattr(block, name)
        if not isinstance(weight, torch.Tensor):  # absent (a shared expert's gate), or packed
            _refuse_packed_bias(block, weight, bias_name)
            continue
        bias = _take_bias(block, bias_name)
        _swap(block, name, make_layer(name, weight, bias, fixed, False))
        replaced += 1
    for entry in block.pinned_expert_stacks:
        name, bias_name = _names(entry)
        stack = getattr(block, name)
        if not isinstance(stack, torch.Tensor):  # kept packed, expert by expert
            _refuse_packed_bias(block, stack, bias_name)
            continue
        biases = _take_bias(block, bias_name)
        _swap(block, name, nn.ModuleList(  # experts[e] as stack[e] was
            make_layer(name, stack[e], None if biases is None else biases[e], fixed, True)
            for e in range(stack.shape[0])))
        replaced += stack.shape[0]
    for name in getattr(block, "pinned_children", ()):
        child = getattr(block, name)
        if child is not None:
            replaced += pack_block(child, fixed, linear, make_layer)
    block.linear = linear
    block.batch_invariant = fixed
    return replaced


def _refuse_packed_bias(block: nn.Module, weight: Any, bias_name: str | None) -> None:
    """A packed weight with a bias beside it: the bias would have to go into its layer (no
    MoE family kept packed has one: gpt-oss' experts, which do, load dequantized)."""
    if weight is not None and bias_name is not None and getattr(block, bias_name) is not None:
        raise ValueError(f"{type(block).__name__}'s {bias_name} beside weights kept packed "
                         f"is not built")


def _names(entry: str | tuple[str, str]) -> tuple[str, str | None]:
    return (entry, None) if isinstance(entry, str) else entry


def _take_bias(block: nn.Module, bias_name: str | None):
    """The bias attribute's tensor (None where there is none); the attribute becomes None."""
    if bias_name is None:
        return None
    bias = getattr(block, bias_name)
    _swap(block, bias_name, None)
    return bias


def _swap(block: nn.Module, name: str, value: Any) -> None:
    delattr(block, name)  # a Module cannot be assigned over a Parameter
    setattr(block, name, value)
