"""One rank's share of an MoE member of the llama family (moe_decoder.py: Qwen3-MoE,
Qwen2-MoE, Mixtral, GLM-4.5) under --tp-size N: the llama family's split
(tensor_parallel.py) for attention, the dense layers and the vocabulary, and DeepSeek's for
the experts (tp_deepseek.py):

  - attention: this rank's query and KV heads (q/k/v rows, their biases; o_proj input
    columns, its bias added by rank 0 only); q/k norms are per head_dim, replicated;
  - the dense MLPs (Qwen's mlp_only_layers, GLM-4.5's first_k_dense_replace layers): their
    width split like any SwiGLU (gate/up rows, down columns);
  - MoE layers: the router (and GLM-4.5's correction bias) replicated, so every rank routes
    every token the same way; the routed experts split by index (expert parallel: a rank
    runs its experts over the tokens routed to them, zeros for the others); the shared
    experts' width split (Qwen2-MoE's sigmoid gate is replicated: it scales each rank's
    partial output, and the sum over ranks is the whole); one all-reduce (the decoder's
    `reduce` after the FFN) sums routed and shared parts.
A rank reads only its share of the checkpoint (read_spec): another rank's experts are never
read.
"""
from __future__ import annotations

from typing import Any

import torch

from kvstrata.runner.models.decoder import ArchSpec
from kvstrata.runner.models.moe_decoder import MoeDecoderForCausalLM
from kvstrata.runner.parallel.tensor_parallel import (TPDecoderForCausalLM, TPGroup,
                                                      even_split)


def _widths(config: Any) -> tuple[int, str, int, str]:
    """(routed expert count, its field, shared experts' total width, its field)."""
    if config.model_type == "glm4_moe":
        return (config.n_routed_experts, "n_routed_experts",
                config.moe_intermediate_size * config.n_shared_experts,
                "moe_intermediate_size * n_shared_experts")
    field = "num_local_experts" if config.model_type == "mixtral" else "num_experts"
    return (int(getattr(config, field)), field,
            int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
            "shared_expert_intermediate_size")


class TPMoeDecoder(TPDecoderForCausalLM, MoeDecoderForCausalLM):
    """TPDecoderForCausalLM's vocabulary-parallel ends, all-reduce and q/k/v/o and dense-MLP
    slicing over MoeDecoderForCausalLM's layers, each holding its rank's experts (MRO: TP
    first, then the MoE decoder, then the plain decoder)."""

    def __init__(self, config: Any, spec: ArchSpec, dtype: torch.dtype, device: torch.device,
                 group: TPGroup):
        r, n = group.rank, group.size
        experts, experts_field, shared, shared_field = _widths(config)
        # Set before the layers are built (MoeDecoderForCausalLM.make_layer reads them).
        self.held_experts = even_split(experts, r, n, experts_field)
        self.shared_cols = even_split(shared, r, n, shared_field) if shared else (0, 0)
        self.shared_parts = n
        super().__init__(config, spec, dtype, device, group)

    def read_spec(self, name: str):
        parts = name.split(".")
        if len(parts) < 6 or parts[:2] != ["model", "layers"]:
            return super().read_spec(name)
        i = int(parts[2])
        if i >= self.dims.num_layers:
            return None  # GLM-4.5's MTP layers: not the causal LM's (load_weight skips them)
        if self.layers[i].moe is None or parts[3] != self.style.block:
            return super().read_spec(name)  # attention, norms, a dense MLP
        if parts[4] == "experts" and parts[5].isdigit():
            lo, hi = self.held_experts
            return "all" if lo <= int(parts[5]) < hi else None
        proj = parts[-2]
        if parts[4] in ("shared_expert", "shared_experts"):  # Qwen2-MoE / GLM-4.5's names
            if proj in ("gate_proj", "up_proj"):
                return ("rows", *self.shared_cols)
            if proj == "down_proj":
                return ("cols", *self.shared_cols)
        return "all"  # the router, its correction bias, Qwen2-MoE's shared_expert_gate


__all__ = ["TPMoeDecoder"]
