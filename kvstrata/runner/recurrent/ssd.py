"""Mamba2's selective state space (SSD) recurrence (Nemotron-H, Mamba2, Granite-4.0-H): the
chunked scan for prefill and the single-token step for decode, in float32.

Per head h, with S the (head_dim, d_state) state, dt_t = clamp(softplus(dt_raw + dt_bias))
and A = -exp(A_log) < 0:
    S <- exp(dt_t A) S + dt_t x_t B_t^T;   y_t = S C_t + D x_t
B and C are shared by the heads of a group (n_groups <= heads). `ssd_step` runs that once for
a batch of decode rows. `ssd_chunk_scan` computes a whole chunk of a prompt at once (the
state-space-duality form): inside a chunk the outputs are a causal, decayed C.B "attention"
over dt x, plus the chunk's start state read through C; each chunk's contribution to the state
is one contraction; only the chunk-to-chunk carry is a loop (length / chunk steps). Padding
with dt = 0 changes neither outputs nor final state, so a chunk need not divide the length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float],
                  softplus=F.softplus) -> torch.Tensor:
    """softplus(dt + dt_bias) clamped to the config's time_step_limit, float32 (`softplus`:
    torch's, or pointwise.softplus under deterministic inference)."""
    dt = softplus(dt.float() + dt_bias.float())
    lo, hi = limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: group g serves heads g * H/G .. (g+1) * H/G - 1."""
    return x.float().repeat_interleave(heads // x.shape[-2], dim=-2)


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor, state: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. x [N, H, P]; dt [N, H] (discretized); A, D [H]; B, C [N, G, Nst];
    state [N, H, P, Nst] (any float dtype). Returns (y [N, H, P], new state), float32."""
    heads = x.shape[1]
    xf = x.float()
    s = state.float() * (dt * A.float()).exp()[..., None, None]
    s = s + (xf * dt[..., None])[..., None] * _heads(B, heads)[:, :, None, :]
    y = torch.einsum("nhpk,nhk->nhp", s, _heads(C, heads)) + xf * D.float()[:, None]
    return y, s


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, state: torch.Tensor | None,
                   chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of sequences. x [B, L, H, P]; dt [B, L, H] (discretized); A, D [H];
    B, C [B, L, G, Nst]; state [B, H, P, Nst] (None: zeros). Returns (y [B, L, H, P],
    final state [B, H, P, Nst]), float32."""
    b, length, heads, p = x.shape
    pad = (-length) % chunk
    n = (length + pad) // chunk
    xf = x.float()
    x_dt = F.pad(xf * dt[..., None], (0, 0, 0, 0, 0, pad)).reshape(b, n, chunk, heads, p)
    Bh = F.pad(_heads(B, heads), (0, 0, 0, 0, 0, pad)).reshape(b, n, chunk, heads, -1)
    Ch = F.pad(_heads(C, heads), (0, 0, 0, 0, 0, pad)).reshape(b, n, chunk, heads, -1)
    log_decay = F.pad(dt * A.float(), (0, 0, 0, pad)).reshape(b, n, chunk, heads)
    cum = log_decay.cumsum(2).permute(0, 1, 3, 2)        # [B, n, H, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).triu(1)
    # decay[l, s] = exp(cum_l - cum_s) for s <= l (masked before exp: no overflow above)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    scores = torch.einsum("bclhn,bcshn->bchls", Ch, Bh) * decay
    y = torch.einsum("bchls,bcshp->bclhp", scores, x_dt)
    to_end = (cum[..., -1:] - cum).exp()                  # [B, n, H, C]
    chunk_states = torch.einsum("bclhn,bchl,bclhp->bchpn", Bh, to_end, x_dt)
    chunk_decay = cum[..., -1].exp()[..., None, None]     # [B, n, H, 1, 1]
    s = (torch.zeros(b, heads, p, Bh.shape[-1], dtype=torch.float32, device=x.device)
         if state is None else state.float().clone())
    starts = torch.empty_like(chunk_states)
    for c in range(n):
        starts[:, c] = s
        s = s * chunk_decay[:, c] + chunk_states[:, c]
    read = torch.einsum("bclhn,bchpn->bclhp", Ch, starts) * cum.exp().permute(
        0, 1, 3, 2)[..., None]
    y = (y + read).reshape(b, n * chunk, heads, p)[:, :length]
    return y + xf * D.float()[:, None], s


def ssd_steps(x, dt, A, B, C, D, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token loop over [B, L, ...] inputs, every step's state kept: (y [B, L, H, P],
    states [B, L, H, P, Nst]). A speculative verify commits one of them; tests check the
    chunked scan against it."""
    b, length, heads, p = x.shape
    s = (torch.zeros(b, heads, p, B.shape[-1], dtype=torch.float32, device=x.device)
         if state is None else state.float())
    ys, states = [], []
    for t in range(length):
        y, s = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], D, s)
        ys.append(y)
        states.append(s)
    return torch.stack(ys, 1), torch.stack(states, 1)
