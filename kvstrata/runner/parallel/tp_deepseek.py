"""Tensor parallelism for DeepSeek V2 / V3 / V3.2 (MLA [+ DSA] + MoE), one rank's share:

  - MLA: the attention heads split (q_b_proj -- V2-Lite: q_proj -- and kv_b_proj rows,
    o_proj input columns + all-reduce); the latent (q_a / kv_a projections, their norms)
    is replicated, so every rank writes the same latent KV to its own pool -- the MLA cache
    is replicated, as SGLang keeps it under attention TP;
  - DSA: the indexer is replicated and reads the replicated residual stream, so every rank
    computes the same scores and picks the same top-k (no broadcast needed; gloo's
    all-reduce gives every rank identical sums);
  - MoE: the router is replicated (every rank routes every token the same way) and the
    routed experts are split by index (expert parallel: a rank computes its experts' share,
    zeros for the others); the shared experts' width and the dense MLPs are split like a
    SwiGLU; one all-reduce sums both;
  - embedding and LM head vocab-parallel, as in tensor_parallel.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from kvstrata.runner.models.deepseek import DeepseekForCausalLM
from kvstrata.runner.models.deepseek_config import DeepseekDims
from kvstrata.runner.models.registry import architecture_name
from kvstrata.runner.parallel.tensor_parallel import (TPGroup, even_split, pad_rows,
                                                      vocab_parallel_embed, vocab_rows)


class TPDeepseek(DeepseekForCausalLM):
    def __init__(self, config: Any, raw_config: dict | None, dtype: torch.dtype,
                 device: torch.device, group: TPGroup):
        full = DeepseekDims.from_config(config, architecture_name(config))
        r, n = group.rank, group.size
        heads = even_split(full.num_heads, r, n, "num_attention_heads")
        mlp = even_split(full.intermediate_size, r, n, "intermediate_size")
        experts = even_split(full.n_routed_experts, r, n, "n_routed_experts")
        shared = even_split(full.moe_intermediate_size * full.n_shared_experts, r, n,
                        "the shared experts' width")
        vocab, rows = vocab_rows(full.vocab_size, r, n)
        local = dataclasses.replace(full, num_heads=heads[1] - heads[0],
                                    intermediate_size=mlp[1] - mlp[0], vocab_size=rows)
        super().__init__(config, raw_config, dtype, device, dims=local, experts=experts,
                         shared_parts=n)
        self.full_dims, self.group = full, group
        self.heads, self.mlp_cols, self.experts, self.shared_cols = heads, mlp, experts, shared
        self.vocab, self.vocab_rows = vocab, rows

    @classmethod
    def build(cls, source, config: Any, dtype: torch.dtype, device: torch.device,
              group: TPGroup) -> "TPDeepseek":
        with open(os.path.join(source.path, "config.json"), encoding="utf-8") as fh:
            return cls(config, json.load(fh), dtype, device, group)

    # ---- forward
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embed(self.group, ids, self.embed, *self.vocab)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x, self.lm_head).float()  # packed_linear once packed
        return self.group.all_gather_last(local)[:, :self.full_dims.vocab_size]

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(partial)

    # ---- loading: read only this rank's part of each tensor (runner/models/loader.py)
    def read_spec(self, name: str):
        d = self.full_dims
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return ("rows", *self.vocab)
        parts = name.split(".")
        if len(parts) < 6 or parts[:2] != ["model", "layers"] or \
                int(parts[2]) >= d.num_layers:
            return "all"  # norms, and MTP layers (not the causal LM's)
        if parts[3:5] == ["mlp", "experts"] and parts[5].isdigit():
            return "all" if self.experts[0] <= int(parts[5]) < self.experts[1] else None
        lo, hi = self.heads
        per_head = {"q_b_proj": d.qk_head_dim, "q_proj": d.qk_head_dim,
                    "kv_b_proj": d.qk_nope_head_dim + d.v_head_dim}
        proj, kind = parts[-2], parts[-1]
        if parts[3] == "self_attn" and proj in per_head:  # column-parallel: heads' rows
            return ("rows", lo * per_head[proj], hi * per_head[proj])
        if parts[3] == "self_attn" and proj == "o_proj" and kind == "weight":
            return ("cols", lo * d.v_head_dim, hi * d.v_head_dim)
        if parts[3] == "mlp" and (len(parts) == 6 or parts[4] == "shared_experts"):
            cols = self.shared_cols if parts[4] == "shared_experts" else self.mlp_cols
            if proj in ("gate_proj", "up_proj"):
                return ("rows", *cols)
            if proj == "down_proj":
                return ("cols", *cols)
        return "all"  # latent projections, norms, indexer, router, o_proj bias

    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = pad_rows(tensor, self.vocab_rows)
        elif name.endswith("o_proj.bias") and self.group.rank:
            tensor = torch.zeros_like(tensor)  # a row-parallel bias is added once
        return super().load_weight(name, tensor)


__all__ = ["TPDeepseek"]
