"""One rank's share of gpt-oss (--tp-size N): the llama family's split (tensor_parallel.py)
plus what gpt-oss adds.

- Attention: this rank's query heads (and their sinks) and KV heads; o_proj row-parallel,
  its bias added by rank 0 only. The windows are per layer, the same on every rank.
- Experts: every rank holds every expert, a slice [m0, m1) of each expert's width (the
  intermediate units): the clamped SwiGLU is elementwise per unit, so a rank computes its
  units' share of each expert's down projection and the all-reduce sums the shares. In the
  checkpoint's interleaved gate_up (gate at even columns, up at odd) units m0..m1 are the
  contiguous columns 2*m0 .. 2*m1. The down bias is added by rank 0 only (inside the routing
  weight: sum_k w_k (y_k + b_k) summed over ranks with b on one rank is the whole).
  The router is replicated (every rank routes identically).
- MXFP4 experts are dequantized whole, then sliced: a rank's slice of the width need not be
  whole blocks of 32 (gpt-oss's 2880 at tp 4 is 720 per rank, 22.5 blocks).
"""
from __future__ import annotations

from typing import Any

import torch

from kvstrata.runner.models.decoder import ArchSpec
from kvstrata.runner.models.gpt_oss import GptOssForCausalLM
from kvstrata.runner.parallel.tensor_parallel import TPDecoderForCausalLM, TPGroup


class TPGptOss(TPDecoderForCausalLM, GptOssForCausalLM):
    """TPDecoderForCausalLM's vocabulary-parallel ends, all-reduce and q/k/v/o slicing over
    GptOssForCausalLM's layers (MRO: TP first, then gpt-oss, then the plain decoder)."""

    def __init__(self, config: Any, spec: ArchSpec, dtype: torch.dtype, device: torch.device,
                 group: TPGroup):
        super().__init__(config, spec, dtype, device, group)

    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        if name.endswith(".self_attn.sinks"):
            tensor = tensor[slice(*self.shard.q_heads)]
        return super().load_weight(name, tensor)

    def expert_share(self, what: str, t: torch.Tensor) -> torch.Tensor:
        m0, m1 = self.shard.mlp
        if what in ("gate_up_proj", "gate_up_proj_bias"):  # [E, (H,) 2I]: interleaved pairs
            return t[..., 2 * m0:2 * m1]
        if what == "down_proj":  # [E, I, H]
            return t[:, m0:m1]
        if what == "down_proj_bias":
            return t if self.shard.rank == 0 else torch.zeros_like(t)
        raise KeyError(what)


__all__ = ["TPGptOss"]
