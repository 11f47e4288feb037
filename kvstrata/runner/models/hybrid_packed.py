"""The recurrent hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Nemotron-H and its MoE,
Granite-4.0-H, Falcon-H1, Mamba2: hybrid_base.py) on kvstrata's packed linears
(runner/cpu/packed_linear.py), what the llama-family decoder gets from
packed_linear.pack_model and DeepSeek from deepseek_packed.py: kvstrata's bf16 GEMM on
AVX512-BF16 / AMX (AVX2 + FMA where oneDNN has no bf16 kernels), oneDNN's prepacked layout
for fp32 and for widths the GEMM does not take.

Why: every projection ran torch's F.linear on a plain weight; a decode step is a few rows
through each of them, where F.linear is far below the GEMM's speed (docs/benchmarks.md
"Recurrent hybrids on packed linears", benchmarks/ab_hybrid_packed.py).

What is packed, in place (each block names its weights as deterministic inference reads them,
runner/cpu/fixed_experts.py: `pinned_weights`, `pinned_expert_stacks`, `pinned_children`):
  - every block of every layer that names them: attention's q|k|v (Qwen's with its output
    gate rows) and o_proj, Gated DeltaNet's and Mamba2's in_proj / out_proj (with their
    biases), the dense MLPs (SwiGLU, relu^2, Falcon-H1's), the MoE blocks' routers, each
    routed expert, shared experts and Nemotron-H's latent projections (fixed_experts.pack_block,
    as DeepSeek's MoE; an expert keeps one layout);
  - the output head (a tied one gets a packed copy: the lookup keeps the embedding).
The recurrent kernels (conv, scan), norms and activations are untouched. The model and each
block then apply their weights with packed_linear. KVSTRATA_CPU_PACKED_LINEAR=0 keeps
F.linear (model_setup.py); --enable-deterministic-inference pins instead (hybrid_fixed.py);
--quantization w8a8_int8 replaces the same weights by int8 layers (runner/quant/hybrid_w8a8.py).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator

from torch import nn

from kvstrata.runner.cpu import packed_linear as packing
from kvstrata.runner.cpu.fixed_experts import pack_block
from kvstrata.runner.cpu.packed_linear import PackedLinear, kernel_name, packed_linear


def weight_blocks(model: Any) -> Iterator[nn.Module]:
    """Each block of the model's layers that names its linear weights (a layer's mixer, its
    MLP / MoE / shared MLP, Falcon-H1's attention, mixer and MLP), once."""
    for layer in model.layers:
        for child in layer.children():
            if hasattr(child, "pinned_weights"):
                yield child


def available(model: Any) -> bool:
    """packed_linear.available's judgement (oneDNN present, a CPU float32 / bf16 weight, a
    bf16 GEMM on this CPU) on the model's output head, which every hybrid has."""
    probe = SimpleNamespace(head=model.lm_head)
    return packing.available(SimpleNamespace(layers=[probe], packed_linears=(("head", None),)))


def pack_hybrid_model(model: Any) -> dict:
    """Pack a loaded hybrid model's linears in place (module docstring); returns what ran (for
    /server_info, as packed_linear.pack_model's)."""
    replaced = sum(pack_block(block) for block in weight_blocks(model))
    tied = model.lm_head is model.embed
    head = PackedLinear(model.lm_head)
    delattr(model, "lm_head")  # a Module cannot be assigned over a Parameter
    model.lm_head = head
    model.linear = packed_linear
    return {"quantization": None, "kernel": kernel_name(head),
            "tied_output_projection_copy": tied, "packed_weights": replaced + 1}


__all__ = ["available", "pack_hybrid_model", "weight_blocks"]
