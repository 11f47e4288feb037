"""The Mamba2 token mixer of Nemotron-H and Mamba2 (a `linear_attention` / mamba layer),
checked against transformers' Mamba2Mixer / NemotronHMamba2Mixer (their torch path):

  in_proj -> gate (intermediate), xBC (intermediate + 2 * n_groups * d_state), dt (heads)
  xBC     -> causal conv1d (kernel conv_kernel, bias use_conv_bias) + SiLU -> x, B, C
  dt = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
  y = SSD scan over (x, dt, A, B, C) from the request's state, + D * x     (recurrent/)
  out_proj( weight * groupRMSNorm(y * silu(gate)) )   (float32, n_groups norm groups)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.runner.models.hybrid_base import param
from kvstrata.runner.recurrent.ssd import discretize_dt


@dataclass(frozen=True)
class Mamba2Shape:
    hidden: int
    heads: int
    head_dim: int
    d_state: int
    n_groups: int
    kernel: int
    conv_bias: bool
    proj_bias: bool
    eps: float
    time_step_limit: tuple[float, float]

    @property
    def intermediate(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.d_state


def time_step_limit(config: Any) -> tuple[float, float]:
    lo, hi = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
    return float(lo), float(hi)


def mamba2_shape(config: Any, act: str, heads: int, head_dim: int, d_state: int
                 ) -> Mamba2Shape:
    """The mixer's shape from a config whose own names for the activation, heads, head dim
    and state size are passed in (Nemotron-H's mamba_* fields, Mamba2's plain ones); the
    other fields are named alike in both."""
    if act != "silu":
        raise ValueError(f"{config.model_type}: the Mamba2 layers' activation {act!r} is not "
                         f"supported (SiLU)")
    return Mamba2Shape(config.hidden_size, heads, head_dim, d_state, config.n_groups,
                       config.conv_kernel, bool(config.use_conv_bias), bool(config.use_bias),
                       float(config.layer_norm_epsilon), time_step_limit(config))


class Mamba2Mixer(nn.Module):
    def __init__(self, s: Mamba2Shape, dtype: torch.dtype, device: torch.device):
        super().__init__()
        if s.heads % s.n_groups:
            raise ValueError(f"Mamba2: {s.heads} heads are not a multiple of n_groups "
                             f"{s.n_groups}")
        self.s = s
        kw = dict(dtype=dtype, device=device)
        out = s.intermediate + s.conv_dim + s.heads
        self.in_proj = param(out, s.hidden, **kw)
        self.in_bias = param(out, **kw) if s.proj_bias else None
        self.conv_weight = param(s.conv_dim, s.kernel, **kw)
        self.conv_bias = param(s.conv_dim, **kw) if s.conv_bias else None
        self.dt_bias, self.A_log, self.D = (param(s.heads, **kw) for _ in range(3))
        self.norm = param(s.intermediate, **kw)
        self.out_proj = param(s.hidden, s.intermediate, **kw)
        self.out_bias = param(s.hidden, **kw) if s.proj_bias else None

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.s.conv_dim, self.s.kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.s.heads, self.s.head_dim, self.s.d_state)

    def register(self, model, prefix: str) -> None:
        e = model.expect
        e(f"{prefix}.in_proj.weight", self.in_proj)
        e(f"{prefix}.conv1d.weight", self.conv_weight, transform=lambda w: w[:, 0])
        for name in ("dt_bias", "A_log", "D"):
            e(f"{prefix}.{name}", getattr(self, name))
        e(f"{prefix}.norm.weight", self.norm)
        e(f"{prefix}.out_proj.weight", self.out_proj)
        for name, target in (("in_proj.bias", self.in_bias), ("conv1d.bias", self.conv_bias),
                             ("out_proj.bias", self.out_bias)):
            if target is not None:
                e(f"{prefix}.{name}", target)

    def forward(self, x: torch.Tensor, layer: int, fb, backend) -> torch.Tensor:
        s = self.s
        t, inter, conv_dim = x.shape[0], s.intermediate, s.conv_dim
        gn = s.n_groups * s.d_state
        proj = F.linear(x, self.in_proj, self.in_bias)
        xbc = backend.conv(layer, fb, proj[:, inter:inter + conv_dim], self.conv_weight,
                           self.conv_bias)
        dt = discretize_dt(proj[:, inter + conv_dim:], self.dt_bias, s.time_step_limit)
        y = backend.ssd(layer, fb, xbc[:, :inter].reshape(t, s.heads, s.head_dim), dt,
                        -self.A_log.float().exp(),
                        xbc[:, inter:inter + gn].reshape(t, s.n_groups, s.d_state),
                        xbc[:, inter + gn:].reshape(t, s.n_groups, s.d_state), self.D)
        # Gated group RMSNorm in float32 (the scan's output dtype in transformers' prefill).
        y = y.reshape(t, inter) * F.silu(proj[:, :inter].float())
        groups = y.view(t, s.n_groups, inter // s.n_groups)
        y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + s.eps)).view(t, inter)
        return F.linear((self.norm * y).to(x.dtype), self.out_proj, self.out_bias)
