"""Deterministic inference (--enable-deterministic-inference) for the recurrent hybrids:
Qwen3.5 and Qwen3-Next (Gated DeltaNet), Nemotron-H and Mamba2 (Mamba2 layers). A request's
tokens and logprobs are then a function of its own tokens: not of its batch, its prefill
chunks, or where its KV pages and state came from (a state snapshot at a prefix hit, a
retraction's recompute, HiCache, PD).

`pin_hybrid_model` rewires a loaded model in place:
  - every linear (a mixer's in / out projections, attention's q|k|v and o, the MLPs, Qwen3-Next's
    router, experts and shared expert, the output head) on kvstrata's fixed GEMM
    (packed_linear.PackedLinear._init_fixed, fixed_experts.pin_block), one summation order per
    output whatever the row count;
  - the recurrent layers' conv and scan on fixed_scan.FixedRecurrentBackend: every token,
    prompt or decode, advances its state through the one-token C step, in order;
  - their sigmoid, SiLU and softplus (beta, the decay g, Mamba2's dt, the gated norm's gate,
    the conv's SiLU) and Qwen3.5 attention's output-gate sigmoid position-free
    (recurrent/pointwise.py: torch's element-wise kernels round an element by its place in
    the flattened tensor);
  - Qwen3.5's rotary cos / sin from a table of fixed blocks of positions
    (deepseek_fixed.BlockedCosSin), and the rotation as separately rounded products and sum
    (torch's addcmul may fuse them in its scalar tail and not in its vector body).
Attention layers run the paged decode kernel for every query (the attention backend's
`deterministic`, as for the dense models). Norms are per row (fused_ops.rms_norm, or torch's
reductions over a contiguous last dimension), MLP activations per row (fused_ops.silu_mul,
relu^2 exact).
Not built: Nemotron-H's MoE layers, Granite-4.0-H, Falcon-H1 (refused by name here and in
config/rules/deterministic.py), speculative verify entries, --tp-size > 1.
"""
from __future__ import annotations

from typing import Any

import torch

from kvstrata.runner.cpu.fixed_experts import pin_block
from kvstrata.runner.cpu.packed_linear import PackedLinear, kernel_name, packed_linear
from kvstrata.runner.models.deepseek_fixed import BlockedCosSin
from kvstrata.runner.models.nemotron_h_moe import NemotronHMoE
from kvstrata.runner.models.qwen3_next import GatedAttention
from kvstrata.runner.recurrent import fixed_scan, pointwise

# The classes this module pins (config/rules/deterministic.py names their architectures)
PINNED_CLASSES = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM", "NemotronHForCausalLM",
                  "Mamba2ForCausalLM")


def exact_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope.apply_rope's rotation (sin signed as rope.cos_sin returns it) with each product
    and the sum rounded on its own: the same bits for a token wherever it sits."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


def pin_hybrid_model(model: Any) -> dict:
    """Pin a loaded hybrid model in place (module docstring); returns what ran (for
    /server_info, as packed_linear.pack_model's)."""
    name = type(model).__name__
    if name not in PINNED_CLASSES:
        raise NotImplementedError(f"not implemented yet: --enable-deterministic-inference on "
                                  f"{name} (built for {', '.join(PINNED_CLASSES)})")
    moe_layers = 0
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mixer, NemotronHMoE):  # not pinned yet (its packing: hybrid_packed)
            raise NotImplementedError(f"not implemented yet: --enable-deterministic-inference "
                                      f"on {name} with a {type(layer.mixer).__name__} layer "
                                      f"({i})")
        pin_block(layer.mixer)
        if hasattr(layer.mixer, "act"):
            layer.mixer.act = pointwise.POSITION_FREE
        if isinstance(layer.mixer, GatedAttention):
            layer.mixer.gate_sigmoid = pointwise.sigmoid
        mlp = getattr(layer, "mlp", None)
        if mlp is not None:
            pin_block(mlp)  # a dense SwiGLU, or Qwen3-Next's MoE block
            moe_layers += hasattr(mlp, "router")
    tied = model.lm_head is model.embed
    head = PackedLinear(model.lm_head, fixed=True)
    delattr(model, "lm_head")  # a Module cannot be assigned over a Parameter
    model.lm_head = head
    model.linear = packed_linear
    if hasattr(model, "rotary"):
        # an instance attribute over the method: cos_sin reads the blocked table
        model.rotary.plain_cos_sin = BlockedCosSin(model.rotary.plain_cos_sin)
        model.rope = exact_rope
    model.recurrent_backend = fixed_scan.FixedRecurrentBackend(model.recurrent_backend.pool)
    return {"quantization": None, "kernel": kernel_name(model.lm_head),
            "tied_output_projection_copy": tied, "pinned_moe_layers": moe_layers,
            "recurrent_kernel": fixed_scan.KERNEL}
