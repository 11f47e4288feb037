"""The Gated DeltaNet token mixer of Qwen3-Next and Qwen3.5 (a `linear_attention` layer),
checked against transformers' Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet:

  in_proj -> q, k, v (the conv's channels, in that order), z (the output gate), b, a
  q|k|v   -> causal conv1d (kernel linear_conv_kernel_dim, no bias) + SiLU
  beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)      (float32)
  o = gated delta rule over (q, k, v, g, beta) from the request's state (recurrent/)
  out_proj( RMSNorm_per_head(o) * silu(z) )                  (the norm's plain weight)

Our in_proj is one matrix with rows [q | k | v | z | b | a]. Qwen3.5 stores them as
in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (already in that order); Qwen3-Next as
in_proj_qkvz and in_proj_ba grouped per key head ([q_i, k_i, v_i, z_i] for key head i, value
heads i*r .. i*r + r - 1), which `_ungroup` reorders at load.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.runner.models.hybrid_base import param
from kvstrata.runner.recurrent import pointwise


class GatedDeltaNet(nn.Module):
    # How its projections and activations run: torch's, or once deterministic inference
    # pinned them (runner/models/hybrid_fixed.py) the fixed GEMM and position-free ops
    linear = staticmethod(F.linear)
    act = pointwise.TORCH
    pinned_weights = ("in_proj", "out_proj")
    pinned_expert_stacks = ()

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.hk, self.hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        if self.hv % self.hk:
            raise ValueError(f"linear_num_value_heads {self.hv} is not a multiple of "
                             f"linear_num_key_heads {self.hk}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Gated DeltaNet: hidden_act {config.hidden_act!r} is not "
                             f"supported (the conv's activation is SiLU)")
        self.kernel = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        h = config.hidden_size
        kw = dict(dtype=dtype, device=device)
        self.in_proj = param(self.conv_dim + self.value_dim + 2 * self.hv, h, **kw)
        self.conv_weight = param(self.conv_dim, self.kernel, **kw)
        self.dt_bias = param(self.hv, **kw)
        self.A_log = param(self.hv, **kw)
        self.norm = param(self.dv, **kw)
        self.out_proj = param(h, self.value_dim, **kw)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.hv, self.dk, self.dv)

    def register(self, model, prefix: str) -> None:
        """This layer's checkpoint names (Qwen3.5's or Qwen3-Next's) in the model's table."""
        c, z, hv = self.conv_dim, self.value_dim, self.hv
        e = model.expect
        e(f"{prefix}.conv1d.weight", self.conv_weight, transform=lambda w: w[:, 0])
        for name in ("dt_bias", "A_log"):
            e(f"{prefix}.{name}", getattr(self, name))
        e(f"{prefix}.norm.weight", self.norm)
        e(f"{prefix}.out_proj.weight", self.out_proj)
        if model.grouped_in_proj:  # Qwen3-Next
            e(f"{prefix}.in_proj_qkvz.weight", self.in_proj, (0, c + z),
              lambda w: self._ungroup(w, (self.dk, self.dk, self._r * self.dv,
                                          self._r * self.dv)))
            e(f"{prefix}.in_proj_ba.weight", self.in_proj, (c + z, c + z + 2 * hv),
              lambda w: self._ungroup(w, (self._r, self._r)))
        else:  # Qwen3.5
            e(f"{prefix}.in_proj_qkv.weight", self.in_proj, (0, c))
            e(f"{prefix}.in_proj_z.weight", self.in_proj, (c, c + z))
            e(f"{prefix}.in_proj_b.weight", self.in_proj, (c + z, c + z + hv))
            e(f"{prefix}.in_proj_a.weight", self.in_proj, (c + z + hv, c + z + 2 * hv))

    @property
    def _r(self) -> int:
        return self.hv // self.hk

    def _ungroup(self, w: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
        """Rows grouped per key head [part_0 | part_1 | ...]_head -> [part_0 of every head |
        part_1 of every head | ...]."""
        grouped = w.reshape(self.hk, sum(parts), w.shape[-1]).split(list(parts), dim=1)
        return torch.cat([p.reshape(-1, w.shape[-1]) for p in grouped])

    def forward(self, x: torch.Tensor, layer: int, fb, backend) -> torch.Tensor:
        t = x.shape[0]
        c, zd = self.conv_dim, self.value_dim
        proj = self.linear(x, self.in_proj)
        qkv = backend.conv(layer, fb, proj[:, :c], self.conv_weight, None)
        q = qkv[:, :self.key_dim].reshape(t, self.hk, self.dk)
        k = qkv[:, self.key_dim:2 * self.key_dim].reshape(t, self.hk, self.dk)
        v = qkv[:, 2 * self.key_dim:].reshape(t, self.hv, self.dv)
        b, a = proj[:, c + zd:c + zd + self.hv], proj[:, c + zd + self.hv:]
        beta = self.act.sigmoid(b)
        g = -self.A_log.float().exp() * self.act.softplus(a.float() + self.dt_bias.float())
        o = backend.gated_delta(layer, fb, q, k, v, g, beta).to(x.dtype)
        # Gated RMSNorm per value head: normalise in float32, weight in the model dtype, then
        # the gate in float32 (transformers' Qwen3NextRMSNormGated).
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        z = proj[:, c:c + zd].reshape(t, self.hv, self.dv)
        gated = (self.norm * of.to(x.dtype)) * self.act.silu(z.float())
        return self.linear(gated.to(x.dtype).reshape(t, zd), self.out_proj)
