"""Float32 and bf16 linear layers on the CPU with oneDNN-prepacked weights (the float path's
GEMMs).

Why: a decode step is a batch of M = 32-ish rows through every linear layer, and torch's
`F.linear` (MKL on an un-packed [N, K] weight) runs those shapes far below the FMA peak.
oneDNN's linear over a weight reordered once into its blocked layout measured, at SmolLM2
shapes on the 2-core box (2 threads): 576->3072 at M=32 0.88 -> 0.58 ms, 1536->576 0.40 ->
0.30 ms, the 49152-wide output head 24.4 -> 10.4 ms, and a 2048-row prefill GEMM 40 -> 33 ms
(the bench of record is benchmarks/bench_decode_step.py). Results differ from F.linear by
float rounding only (accumulation order).

The ops (`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`) are the ones
torch.compile's CPU backend emits for the same purpose. Applied once after load to the
llama-family decoder in float32 or bf16 on the CPU, when torch has oneDNN; KVSTRATA_CPU_PACKED_LINEAR=0
keeps F.linear (ablation). `--quantization w8a8_int8` replaces these layers instead.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

KERNEL = "oneDNN prepacked fp32/bf16 (torch.ops.mkldnn._linear_pointwise)"
# The decoder's linear weights: (weight attribute, bias attribute), as in quantization.py.
LAYER_LINEARS = (("qkv_weight", "qkv_bias"), ("o_weight", "o_bias"),
                 ("gate_up_weight", "gate_up_bias"), ("down_weight", "down_bias"))
# Batch-size hint for the weight layout; measured indifferent between 32 and 2048 rows.
PACK_ROWS_HINT = 32


# bf16 too: oneDNN reorders a plain bf16 weight for its AVX-512 BF16 / AMX kernels on every
# F.linear call; packed once it measured 1.6-2.3x faster at decode shapes (M = 1-32) on an AMX
# box and equal at prefill shapes, bit-identical (fp16 is not measured, so not packed).
DTYPES = (torch.float32, torch.bfloat16)


def available(model: Any) -> bool:
    weight = model.layers[0].qkv_weight if len(model.layers) else None
    if not (torch.backends.mkldnn.is_available() and isinstance(weight, torch.Tensor)
            and weight.dtype in DTYPES and weight.device.type == "cpu"):
        return False
    # oneDNN's bf16 kernels need AVX-512 (BW/VL) at least; elsewhere bf16 stays on F.linear.
    return weight.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """A weight (and bias) in oneDNN's layout; call through `packed_linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                              PACK_ROWS_HINT)
        self.bias = None if bias is None else bias.detach().clone()
        size = weight.element_size()
        self.nbytes = weight.numel() * size + (0 if bias is None else bias.numel() * size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def packed_linear(x: torch.Tensor, layer: PackedLinear,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for F.linear(x, weight, bias) once `weight` became a PackedLinear (which holds
    its bias, so `bias` is None)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), layer.packed, layer.bias, "none",
                                              [], "")


def _replace(owner: nn.Module, weight_name: str, bias_name: str | None) -> None:
    weight = getattr(owner, weight_name)
    bias = getattr(owner, bias_name) if bias_name else None
    packed = PackedLinear(weight, bias)
    delattr(owner, weight_name)  # a Module cannot be assigned over a Parameter
    setattr(owner, weight_name, packed)
    if bias_name and bias is not None:
        delattr(owner, bias_name)
        setattr(owner, bias_name, None)


def _pack_layers(model: Any) -> None:
    for layer in model.layers:
        for weight_name, bias_name in LAYER_LINEARS:
            _replace(layer, weight_name, bias_name)


def pack_model(model: Any) -> dict:
    """Pack every linear layer of a loaded float32 / bf16 DecoderForCausalLM in place; returns what
    ran (for /server_info). A tied output head gets a packed copy (the lookup keeps the
    plain embedding matrix)."""
    _pack_layers(model)
    tied = model.lm_head is model.embed
    if tied:
        head = PackedLinear(model.embed)
        delattr(model, "lm_head")
        model.lm_head = head
    else:
        _replace(model, "lm_head", None)
    model.linear = packed_linear
    return {"quantization": None, "kernel": KERNEL, "tied_output_projection_copy": tied}


def pack_draft_head(head: Any) -> dict:
    """Pack an EAGLE / EAGLE3 head's decoder layer(s) and fc in place (the head borrows the
    target's embedding and output head, which the target packed already). Its forwards are
    one-row-per-request GEMMs like a decode step's, where F.linear is slowest."""
    _pack_layers(head)
    _replace(head, "fc_weight", "fc_bias")
    if isinstance(getattr(head, "lm_head", None), torch.Tensor):  # EAGLE3's own (hot) head
        _replace(head, "lm_head", None)
    head.linear = packed_linear
    return {"quantization": None, "kernel": KERNEL}

