"""DeepSeek-V3 FFNs: the dense SwiGLU MLP of the first layers and the MoE block (sigmoid
router with group-limited top-k and a score-correction bias, routed experts, shared experts).

Routing is the reference's arithmetic in float32: scores = sigmoid(x W^T); the bias only
*chooses* experts (scores + bias), the weights are the unbiased scores of the chosen ones,
normalised to sum 1 when norm_topk_prob, times routed_scaling_factor. Groups: the
`topk_group` groups with the best sum of their two best biased scores stay eligible.
Experts run one matmul pair per expert over the tokens routed to it, sorted by expert
(CPU: per-op cost dominates, and a token batch rarely hits every expert).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DenseMLP(nn.Module):
    """SwiGLU with gate|up fused into one weight (rows 0..I-1 gate, I..2I-1 up)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = _param(2 * intermediate, hidden, dtype=dtype, device=device)
        self.down = _param(hidden, intermediate, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)


class MoE(nn.Module):
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
        self.score_bias = _param(e, dtype=torch.float32, device=device)
        self.gate_up = _param(local, 2 * i, h, dtype=dtype, device=device)
        self.down = _param(local, h, i, dtype=dtype, device=device)
        self.shared = DenseMLP(h, i * d.n_shared_experts // shared_parts, dtype, device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], weights [T, k] float32)."""
        d = self.d
        t = x.shape[0]
        scores = F.linear(x.float(), self.router).sigmoid()
        choice = scores + self.score_bias
        per_group = d.n_routed_experts // d.n_group
        group_scores = choice.view(t, d.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(d.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        eligible = group_mask[:, :, None].expand(t, d.n_group, per_group).reshape(t, -1)
        choice = choice.masked_fill(eligible == 0, float("-inf"))
        ids = choice.topk(d.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if d.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * d.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        lo = self.experts[0]

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(xs, self.gate_up[e - lo]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, self.down[e - lo])

        # The routing weights are float32: a bf16 model's expert outputs are weighted and
        # summed over its k experts in float32 and rounded once, as transformers does.
        return routed_sum(x, ids, weights, self.d.n_routed_experts, expert,
                          self.experts) + self.shared(x)


def routed_sum(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
               expert: Callable[[int, torch.Tensor], torch.Tensor],
               held: tuple[int, int] | None = None) -> torch.Tensor:
    """sum over j of weights[t, j] * expert(ids[t, j], x[t]) for every token t, in x's dtype.

    `expert(e, xs)` runs expert e over a [n, H] slice of tokens: one call (a matmul or two)
    per expert that some token chose. `held`: the experts [lo, hi) this rank holds (another
    rank's contribute zeros). The (token, slot) pairs are sorted by expert once: each expert
    then reads one contiguous slice (no per-expert search, no scatter-add), and the results go
    back to their pairs with one permutation. Each token sums its k expert outputs (for k = 2
    the same sum as the references' per-expert accumulation, whichever order); the products
    are taken in the weights' dtype (float32 for DeepSeek, the model's for gpt-oss)."""
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
    per_pair = torch.empty_like(ys).index_copy_(0, order, ys)
    return per_pair.view(t, k, -1).sum(dim=1).to(x.dtype)
