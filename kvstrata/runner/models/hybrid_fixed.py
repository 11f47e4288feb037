"""Deterministic inference (--enable-deterministic-inference) for the recurrent hybrids:
Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet), Nemotron-H (its MoE layers too), Mamba2,
Granite-4.0-H and Falcon-H1 (Mamba2 layers). A request's tokens and logprobs are then a
function of its own tokens: not of its batch, its prefill chunks, or where its KV pages and
state came from (a state snapshot at a prefix hit, a retraction's recompute, HiCache, PD).

`pin_hybrid_model` rewires a loaded model in place, block by block of each layer (LAYER_BLOCKS:
a mixer, Falcon-H1's attention and Mamba2 side by side, an MLP, Granite's MoE and its shared
MLP):
  - every linear (a mixer's in / out projections, attention's q|k|v and o, the MLPs, the MoE
    routers, experts, latent projections and shared experts, the output head) on kvstrata's
    fixed GEMM (packed_linear.PackedLinear._init_fixed, fixed_experts.pin_block), one
    summation order per output whatever the row count; a MoE block's sigmoid router per row
    (moe.row_sigmoid: Qwen3-Next's shared gate, Nemotron-H's grouped router), its combine in
    each token's own top-k order (moe.routed_sum `ordered`), Granite's silu(gate) * up per
    row (moe.swiglu_of);
  - the recurrent layers' conv and scan on fixed_scan.FixedRecurrentBackend: every token,
    prompt or decode, advances its state through the one-token C step, in order;
  - their sigmoid, SiLU and softplus (beta, the decay g, Mamba2's dt, the gated norm's gate,
    the conv's SiLU), Falcon-H1's MLP SiLU and Qwen3.5 attention's output-gate sigmoid
    position-free (recurrent/pointwise.py: torch's element-wise kernels round an element by
    its place in the flattened tensor);
  - rotary cos / sin (Qwen3.5, Falcon-H1, a Granite with rope) from a table of fixed blocks
    of positions (deepseek_fixed.BlockedCosSin), and the rotation as separately rounded
    products and sum (torch's addcmul may fuse them in its scalar tail and not in its
    vector body).
Attention layers run every query in one order as for the dense models (the attention
backend's `deterministic`: full-attention layers in the prefill kernel's order, windowed ones
in the paged decode kernel's; Granite's and Falcon-H1's attention scales are the backend's
`scale`). Norms are per row (fused_ops.rms_norm, or torch's reductions over a contiguous last
dimension), MLP activations per row (fused_ops.silu_mul, relu^2 exact); the muP multipliers
(Granite, Falcon-H1) are products by a constant, rounded alike wherever an element sits.
Not built: speculative verify entries, --tp-size > 1 (a tensor-parallel rank's class is
refused by name here; config/rules/deterministic.py refuses both first).
"""
from __future__ import annotations

from typing import Any

import torch

from kvstrata.config.rules.deterministic import \
    PINNED_RECURRENT_ARCHITECTURES as PINNED_CLASSES
from kvstrata.runner.cpu.fixed_experts import pin_block
from kvstrata.runner.cpu.packed_linear import PackedLinear, kernel_name, packed_linear
from kvstrata.runner.models.deepseek_fixed import BlockedCosSin
from kvstrata.runner.models.qwen3_next import GatedAttention
from kvstrata.runner.recurrent import fixed_scan, pointwise

# The sub-blocks of a hybrid layer that carry weights (hybrid_base.py's families):
# Qwen3-Next / Nemotron-H / Mamba2 `mixer` (+ `mlp`), Falcon-H1 `attn` + `mamba` + `mlp`,
# Granite-4.0-H `mixer` + `moe` + `shared`
LAYER_BLOCKS = ("mixer", "attn", "mamba", "mlp", "moe", "shared")


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
        for block in (getattr(layer, part, None) for part in LAYER_BLOCKS):
            if block is None:
                continue
            if not hasattr(block, "pinned_weights"):
                raise NotImplementedError(f"not implemented yet: --enable-deterministic-"
                                          f"inference on {name} with a "
                                          f"{type(block).__name__} layer ({i})")
            pin_block(block)
            if hasattr(block, "act"):  # Mamba2 / Gated DeltaNet mixers, Falcon-H1's MLP
                block.act = pointwise.POSITION_FREE
            if hasattr(block, "rope"):  # nemotron_h.Attention (Granite's, Falcon-H1's rope)
                block.rope = exact_rope
            if isinstance(block, GatedAttention):
                block.gate_sigmoid = pointwise.sigmoid
            moe_layers += hasattr(block, "router")  # Qwen3-Next's, Nemotron-H's, Granite's
    tied = model.lm_head is model.embed
    head = PackedLinear(model.lm_head, fixed=True)
    delattr(model, "lm_head")  # a Module cannot be assigned over a Parameter
    model.lm_head = head
    model.linear = packed_linear
    if getattr(model, "rotary", None) is not None:  # a Granite without rope has None
        # an instance attribute over the method: cos_sin reads the blocked table
        model.rotary.plain_cos_sin = BlockedCosSin(model.rotary.plain_cos_sin)
    if hasattr(model, "rope"):  # Qwen3-Next / Qwen3.5 rotate in the model
        model.rope = exact_rope
    model.recurrent_backend = fixed_scan.FixedRecurrentBackend(model.recurrent_backend.pool)
    return {"quantization": None, "kernel": kernel_name(model.lm_head),
            "tied_output_projection_copy": tied, "pinned_moe_layers": moe_layers,
            "recurrent_kernel": fixed_scan.KERNEL}
