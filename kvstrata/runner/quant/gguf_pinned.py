"""Deterministic inference (--enable-deterministic-inference) for a model whose weights stay
packed: a GGUF file kept quantized (`--quantization gguf`) or a GPTQ / AWQ /
compressed-tensors checkpoint kept in GGUF block rows (runner/quant/hf_int.py).

Why: a row's bits must not depend on how many rows share its matmul. Both GGUF kernels
(runner/cpu/gguf_matmul.py: `matmul`, float activations; `matmul_q8`, 8-bit activation
blocks) run one path for every row count and sum each output in one order, so a packed
segment is batch-invariant as it stands (tests/correctness/test_gguf_matmul.py). What is not:
  - a float segment inside a packed layer (an F32 / F16 / BF16 tensor of a fused q|k|v or
    gate|up), which GgufLinear multiplied with F.linear: pinned on a fixed PackedLinear
    (GgufLinear.pin_float_segments);
  - a whole linear the file or checkpoint kept in float (an F16 output head, a GPTQ
    checkpoint's lm_head, a layer in its modules_to_not_convert), which the model's linear
    sent to F.linear: replaced by a fixed PackedLinear (a tied head gets its own copy: the
    embedding lookup keeps the float matrix, as packed_linear.pack_model does).
Everything else of the packed path is per row already: the bias add and the cast of a
GgufLinear's float32 output (one correctly rounded op per element), an act-order layer's
gather of x's columns, an embedding lookup's dequantization of the rows looked up.
An MoE block kept packed (runner/models/moe_decoder.py's Qwen3-MoE, Qwen2-MoE, Mixtral,
GLM-4.5): each expert's GgufLinear is batch-invariant as above whatever number of tokens the
router sends it (its float segments pinned like any GgufLinear's); what the file kept in
float -- usually the router (llama.cpp never quantizes ffn_gate_inp), a shared expert's gate,
a whole float expert stack -- goes on the fixed GEMM as runner/cpu/fixed_experts.py pins a
float block (the block's `pinned_weights` / `pinned_expert_stacks` / `pinned_children`), and
the block sums each token's experts in its own top-k order with per-row sigmoids
(`batch_invariant`).
"""
from __future__ import annotations

from typing import Any

import torch

from kvstrata.runner.cpu import fixed_experts
from kvstrata.runner.cpu.packed_linear import LAYER_LINEARS, PackedLinear, packed_linear
from kvstrata.runner.quant.gguf_linear import GgufLinear


def pin_packed_model(model: Any) -> dict:
    """Every linear of a loaded packed model on a batch-invariant kernel, in place; returns
    what was pinned (for /server_info's quantization_info)."""
    segments = 0
    for layer in {id(m): m for m in model.modules() if type(m) is GgufLinear}.values():
        segments += layer.pin_float_segments()
    whole = 0
    linears = getattr(model, "packed_linears", LAYER_LINEARS)
    for layer in model.layers:
        for weight_name, bias_name in linears:
            if isinstance(getattr(layer, weight_name, None), torch.Tensor):
                _pin(layer, weight_name, bias_name)
                whole += 1
    if isinstance(model.lm_head, torch.Tensor):
        head = PackedLinear(model.lm_head, fixed=True)  # tied: the embedding stays a tensor
        delattr(model, "lm_head")
        model.lm_head = head
        whole += 1
    moe_blocks = [layer.moe for layer in model.layers if getattr(layer, "moe", None) is not None]
    for block in moe_blocks:  # its float weights; its packed ones are batch-invariant
        whole += fixed_experts.pin_block(block, linear=pinned_linear)
    model.linear = pinned_linear
    info = {"batch_invariant": True, "pinned_float_segments": segments,
            "pinned_float_linears": whole}
    return {**info, "pinned_moe_layers": len(moe_blocks)} if moe_blocks else info


def _pin(owner: Any, weight_name: str, bias_name: str | None) -> None:
    weight = getattr(owner, weight_name)
    bias = getattr(owner, bias_name, None) if bias_name else None
    layer = PackedLinear(weight, bias, fixed=True)
    delattr(owner, weight_name)  # a Module cannot be assigned over a Parameter
    setattr(owner, weight_name, layer)
    if bias is not None:
        delattr(owner, bias_name)
        setattr(owner, bias_name, None)


def pinned_linear(x: torch.Tensor, weight: "GgufLinear | PackedLinear | torch.Tensor",
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for F.linear once pin_packed_model ran: a packed layer or a fixed PackedLinear
    (each holds its bias). A plain tensor here is a linear pin_packed_model did not see:
    refused, never multiplied by F.linear's batch-dependent bodies."""
    if type(weight) is GgufLinear:
        return weight.forward(x)
    if isinstance(weight, PackedLinear):
        return packed_linear(x, weight)
    raise RuntimeError(f"deterministic inference: a float weight {tuple(weight.shape)} was "
                       f"not pinned on the fixed GEMM (pin_packed_model)")


__all__ = ["pin_packed_model", "pinned_linear"]
