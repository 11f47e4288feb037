"""Gated DeltaNet's recurrence (Qwen3-Next, Qwen3.5): the chunked rule for prefill and the
single-token step for decode, both in float32 whatever the model dtype.

Per value head, with S the (head_k_dim, head_v_dim) state, g <= 0 the log decay and beta the
write strength of token t (q, k l2-normalised, q scaled by head_k_dim ** -0.5):
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
`gated_delta_step` is that, once, for a batch of decode rows. `chunk_gated_delta` computes the
same for a whole prompt chunk by chunk (CHUNK = 64 tokens, FLA's chunk): inside a chunk the
delta rule's triangular system is solved once (the UT transform: the chunk's writes as
u = M^-1 (beta v) and w = M^-1 (beta k * decay), M = I + strictly-lower(beta K K^T * decay))
so a chunk costs a few batched matmuls; only the chunk-to-chunk state carry is a loop (length
/ 64 steps, never one per token). Padding a sequence with k = v = 0, g = 0 changes neither
its outputs nor its final state, so a chunk need not divide the length.

Query/key heads serve num_v_heads // num_k_heads consecutive value heads each (GVA).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
L2_EPS = 1e-6  # as FLA / transformers: x * rsqrt(sum(x^2) + eps)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> float32 [..., Hv, Dk]: l2-normalised, q scaled, heads repeated."""
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    rep = num_v_heads // q.shape[-2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    return q, k


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv]; state
    [N, Hv, Dk, Dv] (any float dtype). Returns (o [N, Hv, Dv] float32, new state float32)."""
    q, k = prepare_qk(q, k, v.shape[-2])
    s = state.float() * g.float().exp()[..., None, None]
    predicted = torch.einsum("nhkv,nhk->nhv", s, k)
    delta = (v.float() - predicted) * beta.float()[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", s, q), s


def chunk_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, state: torch.Tensor | None, chunk: int = CHUNK
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of sequences. q, k [B, L, Hk, Dk]; v [B, L, Hv, Dv]; g, beta [B, L, Hv];
    state [B, Hv, Dk, Dv] (None: zeros). Returns (o [B, L, Hv, Dv], final state), float32."""
    b, length, hv, dv = v.shape
    q, k = prepare_qk(q, k, hv)
    dk = q.shape[-1]
    pad = (-length) % chunk
    # [B, H, L, ...] padded to whole chunks, then [B, H, n, C, ...]
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v.float()))
    g, beta = (F.pad(x.float().transpose(1, 2), (0, pad)) for x in (g, beta))
    n = (length + pad) // chunk
    q, k, v = (x.reshape(b, hv, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(b, hv, n, chunk), beta.reshape(b, hv, n, chunk)

    cum = g.cumsum(-1)                                   # log decay from the chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (masked before exp: no overflow above)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay      # diagonal taken as 1 below
    # u = M^-1 (beta v) and w = M^-1 (beta k * decay) in one solve (one copy of M for LAPACK)
    uw = torch.linalg.solve_triangular(
        system, torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1),
        upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay             # within-chunk q.k (causal, decayed)
    # The chunk loop's operands chunk-major and contiguous (a slice per chunk, no copies):
    # [w ; q * decay] read the state at the chunk start in one matmul; k^T decayed to the
    # chunk end writes it.
    u = uw[..., :dv].movedim(2, 0).contiguous()
    reads = torch.cat([uw[..., dv:], q * cum.exp()[..., None]], dim=-2).movedim(2, 0)
    reads = reads.contiguous()
    attn = attn.movedim(2, 0).contiguous()
    writes = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2).movedim(2, 0)
    writes = writes.contiguous()
    chunk_decay = cum[..., -1].exp().movedim(2, 0)[..., None, None]  # [n, B, H, 1, 1]

    s = (torch.zeros(b, hv, dk, dv, dtype=torch.float32, device=q.device) if state is None
         else state.float().clone())
    out = torch.empty(n, b, hv, chunk, dv, dtype=torch.float32, device=q.device)
    for c in range(n):
        read = reads[c] @ s                              # [B, H, 2C, Dv]
        v_new = u[c] - read[..., :chunk, :]
        torch.baddbmm(read[..., chunk:, :].reshape(-1, chunk, dv),
                      attn[c].reshape(-1, chunk, chunk), v_new.reshape(-1, chunk, dv),
                      out=out[c].view(-1, chunk, dv))
        s = torch.baddbmm((s * chunk_decay[c]).reshape(-1, dk, dv),
                          writes[c].reshape(-1, dk, chunk),
                          v_new.reshape(-1, chunk, dv)).view(b, hv, dk, dv)
    out = out.movedim(0, 2)
    out = out.reshape(b, hv, n * chunk, dv)[:, :, :length].transpose(1, 2)
    return out, s


def gated_delta_steps(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token loop (the definition) over chunk_gated_delta's [B, L, ...] inputs,
    every step's state kept: (o [B, L, Hv, Dv], states [B, L, Hv, Dk, Dv]), float32. A
    speculative verify commits one of them; tests check the chunked rule against it."""
    b, length, hv, dv = v.shape
    s = (torch.zeros(b, hv, q.shape[-1], dv, dtype=torch.float32, device=v.device)
         if state is None else state.float())
    outs, states = [], []
    for t in range(length):
        o, s = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        outs.append(o)
        states.append(s)
    return torch.stack(outs, 1), torch.stack(states, 1)
