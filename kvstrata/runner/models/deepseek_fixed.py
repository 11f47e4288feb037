"""Deterministic inference for DeepSeek-V2 / V3 / V3.2 (MLA, and V3.2's DSA indexer): every
matmul of a loaded model on kvstrata's fixed GEMM (packed_linear.PackedLinear._init_fixed),
whose row results never depend on how many rows share the call.

What runs where once pinned (the attention itself: runner/attention/mla_fixed.py), packed as
serving packs them (deepseek_packed.pack_mla_model, here with fixed=True):
  - the latent and query projections (q_proj or q_a / q_b, kv_a), o_proj, the indexer's
    wq_b, wk and float32 weights_proj, and the output head: packed_linear.pack_model over
    DeepseekForCausalLM.packed_linears;
  - kv_b_proj's halves, which the absorbed attention applies per head (an einsum over the
    batch's tokens, a batched matmul whose blocking follows the token count): one fixed
    GEMM per head for the key half ([R, nope]: q_nope -> latent) and one for the value half
    ([v, R]: latent output -> v), beside the plain kv_b_proj (kept: nothing else reads it
    once pinned, but the weight map names it);
  - every layer's FFN: the dense SwiGLU of the first layers and the MoE blocks (router,
    each routed expert, the shared experts; fixed_experts.pack_block), whose router sigmoid
    runs per row and whose combine sums each token's experts in its own top-k order;
  - rotary cos / sin from a table of fixed blocks of positions (BlockedCosSin): torch's cos
    and sin over a forward's [T, r] angles run a vector body and a scalar tail (another
    approximation) at offsets that follow T and the thread split, so a position's values
    followed its batch.
"""
from __future__ import annotations

from typing import Any

import torch

from kvstrata.runner.models.deepseek_packed import pack_mla_model


def pin_mla_model(model: Any) -> dict:
    """Pin a loaded DeepseekForCausalLM in place (module docstring); returns what ran (for
    /server_info, as pack_model's). The same packing as serving's (deepseek_packed.py), on
    the fixed GEMM, and the rotary table."""
    info = pack_mla_model(model, fixed=True)
    model.fixed_rope = BlockedCosSin(model.rotary.plain_cos_sin)
    return info


class BlockedCosSin:
    """cos / sin (float32, [T, r]) of positions, each read from a table grown in blocks of
    BLOCK positions; a block is computed once by one call of the same shape, so a position's
    values never depend on the positions beside it in a forward."""
    BLOCK = 256

    def __init__(self, cos_sin):
        self.cos_sin = cos_sin  # [n] positions -> (cos, sin) [n, r]
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        have = 0 if self.cos is None else self.cos.shape[0]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > have:
            blocks = [self.cos_sin(torch.arange(lo, lo + self.BLOCK, device=positions.device))
                      for lo in range(have, need, self.BLOCK)]
            self.cos = torch.cat(([] if self.cos is None else [self.cos])
                                 + [c for c, _ in blocks])
            self.sin = torch.cat(([] if self.sin is None else [self.sin])
                                 + [s for _, s in blocks])
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)
