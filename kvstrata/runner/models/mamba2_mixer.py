"""The Mamba2 token mixer of Nemotron-H and Mamba2 (a `linear_attention` / mamba layer),
checked against transformers' Mamba2Mixer / NemotronHMamba2Mixer (their torch path):

  in_proj -> gate (intermediate), xBC (intermediate + 2 * n_groups * d_state), dt (heads)
  xBC     -> causal conv1d (kernel conv_kernel, bias use_conv_bias) + SiLU -> x, B, C
  dt = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
  y = SSD scan over (x, dt, A, B, C) from the request's state, + D * x     (recurrent/)
  out_proj( weight * groupRMSNorm(y * silu(gate)) )   (float32, n_groups norm groups)

Falcon-H1's mixer (falcon_h1.py) differs only where `Mamba2Shape.gated_norm` says (its
`mamba_rms_norm` / `mamba_norm_before_gate`: the group norm before the gate, or no norm at
all), in its out_proj bias (`projectors_bias`, not `mamba_proj_bias`) and in the multipliers
it applies around `project` (a subclass).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.runner.models.hybrid_base import param
from kvstrata.runner.recurrent import pointwise
from kvstrata.runner.recurrent.ssd import discretize_dt


GATED_NORMS = ("gate_then_norm", "norm_then_gate", "gate_only")


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
    # out_proj's bias when it differs from in_proj's (Falcon-H1); None: as proj_bias
    out_bias: bool | None = None
    # how the scan output y meets the gate z (float32):
    #   "gate_then_norm"  weight * groupRMSNorm(y * silu(z))    Mamba2, Nemotron-H, Granite
    #   "norm_then_gate"  weight * groupRMSNorm(y) * silu(z)    Falcon-H1 norm_before_gate
    #   "gate_only"       y * silu(z), no norm weight            Falcon-H1 without mamba_rms_norm
    gated_norm: str = "gate_then_norm"

    def __post_init__(self) -> None:
        if self.gated_norm not in GATED_NORMS:
            raise ValueError(f"Mamba2: gated_norm {self.gated_norm!r} is not one of "
                             f"{GATED_NORMS}")

    @property
    def has_out_bias(self) -> bool:
        return self.proj_bias if self.out_bias is None else self.out_bias

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
    # How its projections and activations run: torch's, or once deterministic inference
    # pinned them (runner/models/hybrid_fixed.py) the fixed GEMM and position-free ops
    linear = staticmethod(F.linear)
    act = pointwise.TORCH
    pinned_weights = (("in_proj", "in_bias"), ("out_proj", "out_bias"))
    pinned_expert_stacks = ()

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
        self.norm = param(s.intermediate, **kw) if s.gated_norm != "gate_only" else None
        self.out_proj = param(s.hidden, s.intermediate, **kw)
        self.out_bias = param(s.hidden, **kw) if s.has_out_bias else None
        # Tensor parallelism with n_groups 1 replicated (runner/parallel/tp_hybrid.py): the
        # one norm group spans every rank's heads, so its mean square is averaged over the
        # ranks (this TPGroup); None: each norm group is whole here.
        self.norm_ranks = None

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
        e(f"{prefix}.out_proj.weight", self.out_proj)
        for name, target in (("norm.weight", self.norm), ("in_proj.bias", self.in_bias),
                             ("conv1d.bias", self.conv_bias),
                             ("out_proj.bias", self.out_bias)):
            if target is not None:
                e(f"{prefix}.{name}", target)

    def forward(self, x: torch.Tensor, layer: int, fb, backend) -> torch.Tensor:
        s = self.s
        t, inter, conv_dim = x.shape[0], s.intermediate, s.conv_dim
        gn = s.n_groups * s.d_state
        proj = self.project(x)
        xbc = backend.conv(layer, fb, proj[:, inter:inter + conv_dim], self.conv_weight,
                           self.conv_bias)
        dt = discretize_dt(proj[:, inter + conv_dim:], self.dt_bias, s.time_step_limit,
                          self.act.softplus)
        y = backend.ssd(layer, fb, xbc[:, :inter].reshape(t, s.heads, s.head_dim), dt,
                        -self.A_log.float().exp(),
                        xbc[:, inter:inter + gn].reshape(t, s.n_groups, s.d_state),
                        xbc[:, inter + gn:].reshape(t, s.n_groups, s.d_state), self.D)
        y = self.gate_and_norm(y.reshape(t, inter).float(), proj[:, :inter].float())
        return self.linear(y.to(x.dtype), self.out_proj, self.out_bias)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """in_proj: gate | xBC | dt (Falcon-H1 scales around it)."""
        return self.linear(x, self.in_proj, self.in_bias)

    def gate_and_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The gated group RMSNorm in float32 (the scan's output dtype in transformers'
        prefill), in the order `gated_norm` says."""
        s = self.s
        if s.gated_norm == "gate_only":
            return y * self.act.silu(gate)
        if s.gated_norm == "gate_then_norm":
            y = y * self.act.silu(gate)
        t, inter = y.shape
        groups = y.view(t, s.n_groups, inter // s.n_groups)
        mean_square = groups.pow(2).mean(-1, keepdim=True)
        if self.norm_ranks is not None:  # every rank holds an equal share of the group
            mean_square = self.norm_ranks.all_reduce(mean_square) / self.norm_ranks.size
        y = self.norm * (groups * torch.rsqrt(mean_square + s.eps)).view(t, inter)
        return y * self.act.silu(gate) if s.gated_norm == "norm_then_gate" else y
