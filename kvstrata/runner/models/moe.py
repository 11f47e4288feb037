"""DeepSeek-V2 / V3 / GLM-4.5 FFNs: the dense SwiGLU MLP of the first layers and the MoE
block (router, routed experts, shared experts).

Routing is the reference's arithmetic in float32. V3 / GLM-4.5 (`scoring` sigmoid):
scores = sigmoid(x W^T); the bias only
*chooses* experts (scores + bias), the weights are the unbiased scores of the chosen ones,
normalised to sum 1 when norm_topk_prob, times routed_scaling_factor. Groups: the
`topk_group` groups with the best sum of their two best biased scores stay eligible.
V2 (`scoring` softmax): softmax over all experts, top-k (greedy, or group_limited_greedy:
only the `topk_group` groups with the best single expert), times routed_scaling_factor.
Experts run one matmul pair per expert over the tokens routed to it, sorted by expert
(CPU: per-op cost dominates, and a token batch rarely hits every expert).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.runner.cpu import fused_ops as cpu_ops


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [..., gate | up] projection: on the CPU one pass per row
    (fused_ops.silu_mul, HF's roundings), whose bits never depend on the other rows -- torch's
    silu over a [rows, I] view runs its vector body and scalar tail at offsets that depend on
    how threads split the whole tensor; elsewhere torch's ops."""
    act = cpu_ops.silu_mul(gate_up)
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
    return act


def swiglu_of(linear: Callable, x: torch.Tensor, gate_up: Any) -> torch.Tensor:
    """swiglu(linear(x, gate_up)); where gate_up is a packed layer that writes silu(gate) * up
    from its GEMM's registers (packed_linear.PackedLinear.linear_silu_mul: the same values),
    in that one pass."""
    fused = getattr(gate_up, "linear_silu_mul", None)
    act = fused(x) if fused is not None else None
    return act if act is not None else swiglu(linear(x, gate_up))


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) elementwise, each element's bits independent of the rest of x (deterministic
    inference): torch's sigmoid runs a contiguous tensor's elements flattened, in vector runs
    with a scalar tail (another exp) and split among threads at any element, so an element's
    bits followed its place in the batch (GLM-4.5's router over a 6- vs 7-token chunk caught
    it). softmax over the last dim runs each row by itself: sigmoid(x) = softmax([x, 0])[0]."""
    pair = torch.stack((x, torch.zeros_like(x)), dim=-1)
    return torch.softmax(pair, dim=-1)[..., 0]


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


# Checkpoint name -> (our tensor, its rows lo..hi or None..None): what loaders copy into.
Targets = dict[str, tuple[torch.Tensor, int | None, int | None]]
SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")


def swiglu_targets(prefix: str, gate_up: torch.Tensor, down: torch.Tensor,
                   names: tuple[str, str, str] = SWIGLU_NAMES) -> Targets:
    """A SwiGLU's gate and up projections (rows of our fused gate|up) and its down one."""
    i = gate_up.shape[0] // 2
    gate, up, down_name = names
    return {f"{prefix}{gate}.weight": (gate_up, 0, i), f"{prefix}{up}.weight": (gate_up, i, 2 * i),
            f"{prefix}{down_name}.weight": (down, None, None)}


@dataclass(frozen=True)
class MoeDims:
    """What `MoE` reads of a model's dims (DeepseekDims has them all); `from_config`: a
    config with V3-style routing and these field names (GLM-4.5's Glm4MoeConfig)."""
    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring: str = "sigmoid"       # router: "sigmoid" (+ correction bias) or "softmax" (V2)
    topk_method: str = "noaux_tc"  # V2: "greedy" or "group_limited_greedy"

    @classmethod
    def from_config(cls, c: Any) -> "MoeDims":
        n_group = int(c.n_group or 1)
        if c.n_routed_experts % n_group:
            raise ValueError(f"{c.model_type}: n_routed_experts must divide into n_group "
                             f"groups")
        return cls(hidden_size=c.hidden_size, moe_intermediate_size=c.moe_intermediate_size,
                   n_routed_experts=c.n_routed_experts, n_shared_experts=c.n_shared_experts,
                   num_experts_per_tok=c.num_experts_per_tok, n_group=n_group,
                   topk_group=int(c.topk_group or 1), norm_topk_prob=bool(c.norm_topk_prob),
                   routed_scaling_factor=float(c.routed_scaling_factor))


class DenseMLP(nn.Module):
    """SwiGLU with gate|up fused into one weight (rows 0..I-1 gate, I..2I-1 up)."""
    # How a weight is applied: F.linear, or kvstrata's fixed GEMM once deterministic
    # inference pinned these weights (runner/cpu/fixed_experts.py)
    linear = staticmethod(F.linear)
    pinned_weights = ("gate_up", "down")
    pinned_expert_stacks = ()

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = _param(2 * intermediate, hidden, dtype=dtype, device=device)
        self.down = _param(hidden, intermediate, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(swiglu_of(self.linear, x, self.gate_up), self.down)

    def checkpoint_targets(self, prefix: str) -> Targets:
        return swiglu_targets(prefix, self.gate_up, self.down)


class ExpertRouting:
    """The router of the module docstring, for a module with `d` (MoeDims), `router` [E, H]
    and `score_bias` [E] (float32; None for V2's softmax), `linear` and `batch_invariant`:
    MoE here, Nemotron-H's MoE block (nemotron_h_moe.py)."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], weights [T, k] float32)."""
        d = self.d
        t = x.shape[0]
        logits = self.linear(x.float(), self.router)
        if d.scoring == "softmax":  # DeepSeek-V2: no bias, never renormalised
            scores = logits.softmax(dim=-1)
            if d.topk_method == "group_limited_greedy":  # groups ranked by their best expert
                eligible = self._eligible(scores.view(t, d.n_group, -1).amax(dim=-1))
                scores = scores.masked_fill(eligible == 0, 0.0)
            weights, ids = scores.topk(d.num_experts_per_tok, dim=-1, sorted=False)
            return ids, weights * d.routed_scaling_factor
        scores = row_sigmoid(logits) if self.batch_invariant else logits.sigmoid()
        choice = scores + self.score_bias
        group_scores = choice.view(t, d.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(self._eligible(group_scores) == 0, float("-inf"))
        ids = choice.topk(d.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if d.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * d.routed_scaling_factor

    def _eligible(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, n_group] scores -> [T, E] mask (1: the expert's group is in the top
        topk_group)."""
        d = self.d
        t = group_scores.shape[0]
        groups = group_scores.topk(d.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        per_group = d.n_routed_experts // d.n_group
        return group_mask[:, :, None].expand(t, d.n_group, per_group).reshape(t, -1)


class MoE(ExpertRouting, nn.Module):
    # Deterministic inference (runner/cpu/fixed_experts.py): what it pins to the fixed GEMM;
    # batch_invariant: the router's sigmoid per row (row_sigmoid), the combine summing each
    # token's experts in its own slot order
    linear = staticmethod(F.linear)
    pinned_weights = ("router",)
    pinned_expert_stacks = ("gate_up", "down")
    pinned_children = ("shared",)
    batch_invariant = False

    def __init__(self, d: Any, dtype: torch.dtype, device: torch.device,
                 experts: tuple[int, int] | None = None, shared_parts: int = 1):
        """`experts`: the routed experts this module holds ([lo, hi), all by default: a
        tensor-parallel rank holds a slice and routes over all of them); `shared_parts`: the
        shared experts' width is split that many ways (a rank's share)."""
        super().__init__()
        self.d = d
        e, h, i = d.n_routed_experts, d.hidden_size, d.moe_intermediate_size
        self.experts = experts or (0, e)
        local = self.experts[1] - self.experts[0]
        # Router weights and bias stay float32 (the reference keeps them so).
        self.router = _param(e, h, dtype=torch.float32, device=device)
        self.score_bias = (_param(e, dtype=torch.float32, device=device)
                           if d.scoring == "sigmoid" else None)  # V2's softmax has none
        self.gate_up = _param(local, 2 * i, h, dtype=dtype, device=device)
        self.down = _param(local, h, i, dtype=dtype, device=device)
        self.shared = DenseMLP(h, i * d.n_shared_experts // shared_parts, dtype, device)

    def checkpoint_targets(self, prefix: str) -> Targets:
        """Names under the layer's `mlp.`: gate (router, correction bias), experts.{e}
        (global expert ids) and shared_experts."""
        out: Targets = {f"{prefix}gate.weight": (self.router, None, None)}
        if self.score_bias is not None:  # V3's correction bias (V2 has none)
            out[f"{prefix}gate.e_score_correction_bias"] = (self.score_bias, None, None)
        lo, hi = self.experts
        for e in range(lo, hi):
            out.update(swiglu_targets(f"{prefix}experts.{e}.", self.gate_up[e - lo],
                                      self.down[e - lo]))
        return {**out, **self.shared.checkpoint_targets(f"{prefix}shared_experts.")}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        lo = self.experts[0]

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            return self.linear(swiglu_of(self.linear, xs, self.gate_up[e - lo]),
                               self.down[e - lo])

        # The routing weights are float32: a bf16 model's expert outputs are weighted and
        # summed over its k experts in float32 and rounded once, as transformers does.
        return routed_sum(x, ids, weights, self.d.n_routed_experts, expert,
                          self.experts, self.batch_invariant) + self.shared(x)


def routed_sum(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
               expert: Callable[[int, torch.Tensor], torch.Tensor],
               held: tuple[int, int] | None = None, ordered: bool = False) -> torch.Tensor:
    """sum over j of weights[t, j] * expert(ids[t, j], x[t]) for every token t, in x's dtype.

    `expert(e, xs)` runs expert e over a [n, H] slice of tokens: one call (a matmul or two)
    per expert that some token chose. `held`: the experts [lo, hi) this rank holds (another
    rank's contribute zeros). The (token, slot) pairs are sorted by expert once: each expert
    then reads one contiguous slice (no per-expert search, no scatter-add), and the results go
    back to their pairs with one permutation. Each token sums its k expert outputs (for k = 2
    the same sum as the references' per-expert accumulation, whichever order); the products
    are taken in the weights' dtype (float32 for DeepSeek, the model's for gpt-oss).
    `ordered` (deterministic inference): each token's k products are added in its slot order
    (its own top-k order) in float32 and rounded once -- one order whatever the batch, stated
    here rather than left to the reduction's choice of body."""
    t, k = ids.shape
    lo, hi = held or (0, num_experts)
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    xs = x.index_select(0, order // k)
    ys = torch.zeros_like(xs) if hi - lo < len(counts) else torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n and lo <= e < hi:
            ys[start:start + n] = expert(e, xs[start:start + n])
        start += n
    ys = ys * weights.reshape(-1)[order, None]
    per_pair = torch.empty_like(ys).index_copy_(0, order, ys).view(t, k, -1)
    if not ordered:
        return per_pair.sum(dim=1).to(x.dtype)
    total = per_pair[:, 0].float()
    for slot in range(1, k):
        total = total + per_pair[:, slot]
    return total.to(x.dtype)
