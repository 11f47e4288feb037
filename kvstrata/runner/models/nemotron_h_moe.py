"""Nemotron-H's MoE block (block type "moe", E in hybrid_override_pattern; Nemotron-3 Nano /
Super), checked against transformers 5.25's NemotronHMoE:

  ids, weights = the DeepSeek-V3 router (moe.py ExpertRouting: sigmoid scores, the
                 correction bias choosing only, `n_group` / `topk_group`, norm_topk_prob,
                 routed_scaling_factor; float32)
  routed       = fc2_latent( sum_k weights_k * down_e(relu(up_e(fc1_latent(x)))^2) )
                 (non-gated relu^2 experts; the latent projections only with moe_latent_size)
  out          = routed + shared(x)    (one relu^2 MLP of moe_shared_expert_intermediate_size,
                                        as transformers builds it whatever n_shared_experts)
Experts are read as transformers saves them (`experts.up_proj` [E, I, in], `experts.down_proj`
[E, in, I]) or one tensor per expert (`experts.{e}.up_proj.weight`, NVIDIA's checkpoints).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.runner.models.hybrid_base import param, stage_packed
from kvstrata.runner.quant.packed_rows import PackedRows
from kvstrata.runner.models.moe import ExpertRouting, MoeDims, routed_sum


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class NemotronHMoE(ExpertRouting, nn.Module):
    # Deterministic inference (runner/models/hybrid_fixed.py through fixed_experts.pin_block):
    # the router, latent projections, every expert and the shared MLP on the fixed GEMM;
    # batch_invariant: the router's sigmoid per row, each token's experts summed in its order
    linear = staticmethod(F.linear)
    pinned_weights = ("router", ("latent_in", "latent_in_bias"),
                      ("latent_out", "latent_out_bias"))
    pinned_expert_stacks = ("up", "down")
    pinned_children = ("shared",)
    batch_invariant = False

    def __init__(self, config: Any, shared: nn.Module, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        if config.mlp_hidden_act != "relu2":
            raise ValueError(f"Nemotron-H: mlp_hidden_act {config.mlp_hidden_act!r} is not "
                             f"supported (relu2)")
        self.d = d = MoeDims.from_config(config)
        if d.n_routed_experts // d.n_group < 2:
            raise ValueError(f"Nemotron-H: n_group {d.n_group} leaves fewer than 2 experts a "
                             f"group (the router sums each group's best two)")
        e, h, i = d.n_routed_experts, d.hidden_size, d.moe_intermediate_size
        latent = config.moe_latent_size
        width = latent or h
        kw = dict(dtype=dtype, device=device)
        self.router = param(e, h, dtype=torch.float32, device=device)
        self.score_bias = param(e, dtype=torch.float32, device=device)
        self.up = param(e, i, width, **kw)
        self.down = param(e, width, i, **kw)
        bias = bool(config.mlp_bias)
        self.latent_in = param(latent, h, **kw) if latent else None
        self.latent_out = param(h, latent, **kw) if latent else None
        self.latent_in_bias = param(latent, **kw) if latent and bias else None
        self.latent_out_bias = param(h, **kw) if latent and bias else None
        self.shared = shared

    def register(self, model, prefix: str) -> None:
        e = model.expect
        e(f"{prefix}.gate.weight", self.router)
        e(f"{prefix}.gate.e_score_correction_bias", self.score_bias)
        for name, target in (("fc1_latent_proj.weight", self.latent_in),
                             ("fc2_latent_proj.weight", self.latent_out),
                             ("fc1_latent_proj.bias", self.latent_in_bias),
                             ("fc2_latent_proj.bias", self.latent_out_bias)):
            if target is not None:
                e(f"{prefix}.{name}", target)
        self.shared.register(model, f"{prefix}.shared_experts")

    def load_expert(self, prefix: str, name: str, tensor: torch.Tensor) -> list[str] | None:
        """Checkpoint tensor `name` (under `prefix`, the block's mixer) into the experts: the
        per-expert names it covers (expert_keys), None when it is not an expert tensor."""
        rest = name[len(prefix) + 1:].split(".") if name.startswith(prefix + ".") else []
        if not rest or rest[0] != "experts":
            return None
        if len(rest) == 2 and rest[1] in ("up_proj", "down_proj"):  # transformers' stacks
            dst, proj, covered = self._stack(rest[1]), rest[1], range(self.d.n_routed_experts)
        elif (len(rest) == 4 and rest[1].isdigit() and rest[2] in ("up_proj", "down_proj")
              and rest[3] == "weight" and int(rest[1]) < self.d.n_routed_experts):
            proj, covered = rest[2], [int(rest[1])]
            dst = self._stack(proj)[covered[0]]
        else:
            return None
        if isinstance(tensor, (PackedRows, list)):  # kept in its blocks (a GGUF file): a
            # stack's experts (a list), or one expert's rows staged on its stack
            slot = None if isinstance(tensor, list) else (self._stack(proj), covered[0])
            stage_packed(dst, None, None, tensor, slot)
            return [f"{prefix}.experts.{e}.{proj}.weight" for e in covered]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected "
                             f"{tuple(dst.shape)}")
        dst.data.copy_(tensor)
        return [f"{prefix}.experts.{e}.{proj}.weight" for e in covered]

    def _stack(self, proj: str) -> torch.Tensor:
        return self.up if proj == "up_proj" else self.down

    def expert_keys(self, prefix: str) -> set[str]:
        """One name per expert and projection: what the checkpoint must cover, in either
        layout."""
        return {f"{prefix}.experts.{e}.{p}.weight" for e in range(self.d.n_routed_experts)
                for p in ("up_proj", "down_proj")}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        h = x if self.latent_in is None else self.linear(x, self.latent_in,
                                                         self.latent_in_bias)

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            return self.linear(relu2(self.linear(xs, self.up[e])), self.down[e])

        routed = routed_sum(h, ids, weights, self.d.n_routed_experts, expert,
                            ordered=self.batch_invariant)
        if self.latent_out is not None:
            routed = self.linear(routed, self.latent_out, self.latent_out_bias)
        return routed + self.shared(x)
