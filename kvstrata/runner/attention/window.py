"""Sliding-window attention, attention sinks and logit soft-capping for the torch-native
backend (torch_native.py), over the ordinary uniform KV pool that keeps every token's K/V, or
with hybrid SWA memory over a second pool of the windowed layers, whose out-of-window pages the
KV manager frees (their SWA table entries then read slot 0, the padding sink: never inside a
window, so never read unmasked).

Window semantics are transformers' (masking_utils.sliding_window_overlay: kv > q - W): with
window W the query at position p sees the keys at positions p - W + 1 .. p, W keys counting
itself. Only attention applies it (as SGLang does for Gemma 3); the pool still holds all KV.

How each piece kind of a step's plan honours a window (the plan is built once per step per
distinct window; a window no query of the step reaches past reuses the full plan):
  fresh   a prompt longer than W: query blocks of FRESH_BLOCK rows, each over the fresh keys
          of its band only, with an explicit band mask (is_causal alone would see too much).
  paged   a chunk after a cached prefix: each query block gathers keys from its first
          query's window start (page-aligned) only, band mask.
  decode / kernel / verify / tree tokens: one-token queries whose explicit key list (one
          key per position, in position order) is cut to its last W entries: the paged
          decode kernel reads fewer slots, no C change.
  ranges  (deterministic) each query's [begin, end) slot range starts W before its end.
The C prefill kernel is causal-only: windowed pieces skip it (pieces the window does not
reach keep it).

Sinks (gpt-oss: a per-head learned logit that joins each row's softmax denominator and has
no value) and soft-capping (Gemma 2: scores = c * tanh(scores / c) after scaling, before
masking) are not in SDPA nor in the prefill kernel: layers that use them run every piece
through `attend_math` (explicit matmul, tanh, masked softmax in fp32). Under deterministic
inference (whose plan makes every cached-forward query a paged decode kernel query) the kernel
pieces instead run the paged decode kernel with its sink logits and soft-cap
(csrc/paged_decode_isa.h): attend_math's sums are not batch-invariant, the kernel's are.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from kvstrata.runner.attention.pieces import Piece, TorchNativeMeta

if TYPE_CHECKING:
    from kvstrata.runner.attention.torch_native import TorchNativeAttnBackend

# Queries per windowed block: a block of B queries scores B + W - 1 keys, so a long prompt
# costs ~n * (B + W) scores instead of n^2; blocks of at least W keep the per-call overhead
# (a gather, a mask, an SDPA call) a small share.
FRESH_BLOCK = 256


def normalise_windows(layer_windows: Sequence[int | None] | None) -> tuple | None:
    """The per-layer windows as a tuple, or None when every layer is full attention."""
    if layer_windows is None:
        return None
    out = []
    for i, w in enumerate(layer_windows):
        if w is not None and (isinstance(w, bool) or int(w) != w or w < 1):
            raise ValueError(f"layer {i}: sliding window {w!r} must be a positive int or None")
        out.append(None if w is None else int(w))
    return tuple(out) if any(w is not None for w in out) else None


def layer_pools(layer_windows: tuple | None, pool: Any, swa_pool: Any) -> list | None:
    """Per layer (its pool, its index there): with an SWA pool the windowed layers fill it in
    order and the full-attention layers the main pool; else every layer is in `pool`."""
    if swa_pool is None:
        n = pool.geom.num_layers if pool is not None else 0
        return [(pool, i) for i in range(n)]
    if layer_windows is None:
        raise ValueError("an SWA pool needs a model with windowed layers")
    out, counts = [], {False: 0, True: 0}
    for w in layer_windows:
        swa = w is not None
        out.append((swa_pool if swa else pool, counts[swa]))
        counts[swa] += 1
    have = (pool.geom.num_layers if pool is not None else 0, swa_pool.geom.num_layers)
    if (counts[False], counts[True]) != have:
        raise ValueError(f"the model has {counts[False]} full-attention and {counts[True]} "
                         f"windowed layers; the pools hold {have[0]} and {have[1]}")
    return out


def plan_windows(fb, layer_windows: tuple, make: Callable, swa_pool: bool = False,
                 share_full: bool = True) -> TorchNativeMeta:
    """The step's plans, once per distinct window (`make(fb, window, swa)`): a window at
    least as long as the step's longest key list changes nothing, so such layers share the
    full plan (its prefill kernel and decode plan included) -- except that with an SWA pool
    (`swa_pool`) a windowed layer's plan reads its key slots from the SWA table, so the full
    plan is made again for them, and without `share_full` (deterministic inference, whose
    full plan sums in the prefill kernel's order and windowed layers in the decode kernel's:
    a layer's order must not change from step to step). Returns layer 0's plan, carrying
    every layer window's in by_window."""
    if fb.query_keys is not None:
        longest = max(len(k) for k in fb.query_keys)
    else:
        longest = max(s + n for s, n in zip(fb.start_pos, fb.q_lens))
    made: dict = {}
    plans: dict = {}
    for w in dict.fromkeys(layer_windows):
        swa = swa_pool and w is not None
        key = (None if w is None or (share_full and w >= longest) else w, swa)
        if key not in made:
            made[key] = make(fb, key[0], swa) if swa else make(fb, key[0])
        plans[w] = made[key]
    meta = plans[layer_windows[0]]
    meta.by_window = plans
    # (decode_plan.py replays one plan over one pool: a mix of pools is not uniform)
    meta.uniform = len({id(plans[w]) for w in layer_windows}) == 1 and not (
        swa_pool and None in layer_windows)
    return meta


def band_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Additive fp32 [len(q_pos), len(k_pos)]: 0 where the key is visible (q - W < k <= q),
    -inf elsewhere. Additive, not bool: torch's CPU SDPA ran a 256-query block 1.5-3x faster
    with a float mask than with a bool one (2 threads, 9/3 heads of 64); the backend casts it
    to the query's dtype once a forward. Every row sees its own key: never all -inf."""
    d = q_pos[:, None] - k_pos[None, :]
    visible = (d >= 0) & (d < window)
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible,
                                                                         float("-inf"))


def blocks(n: int, window: int) -> list[tuple[int, int]]:
    b = max(FRESH_BLOCK, window)
    return [(a, min(a + b, n)) for a in range(0, n, b)]


def fresh_pieces(lo: int, n: int, window: int, device: torch.device) -> list[Piece]:
    """A fresh prompt at flat tokens [lo, lo + n) (positions 0 ..), n > window: SDPA over
    the fresh K/V of each query block's band."""
    pieces = []
    for a, b in blocks(n, window):
        k0 = max(0, a - window + 1)
        mask = band_mask(torch.arange(a, b), torch.arange(k0, b), window)
        pieces.append(Piece("fresh", lo + a, lo + b, mask=mask.to(device), key_lo=lo + k0))
    return pieces


def paged_pieces(backend: "TorchNativeAttnBackend", table: torch.Tensor, row: int, start: int,
                 n: int, off: int, window: int, device: torch.device) -> list[Piece]:
    """n tokens after `start` cached ones (flat [off, off + n)): each query block gathers
    its band's keys from the pool (from a page boundary: whole-page gathers stay possible)."""
    rows_t = torch.tensor([row], dtype=torch.int64).to(device)
    P = backend.page_size
    pieces = []
    for a, b in blocks(n, window):
        q0, q1 = start + a, start + b                      # query positions [q0, q1)
        k0 = max(0, q0 - window + 1) // P * P
        kv_idx, unit, s = backend.kv_index(table, rows_t, q1, [q1], lo=k0)
        mask = band_mask(torch.arange(q0, q1, device=device),
                         torch.arange(k0, k0 + s, device=device), window)
        pieces.append(Piece("paged", off + a, off + b, kv_idx, unit, mask))
    return pieces


def clip(entry: tuple, table: torch.Tensor, window: int) -> tuple:
    """A one-token query (kv_len, flat token, row[, explicit key slots]) over its last
    `window` keys: explicit key slots (one per position, in position order)."""
    n = entry[0]
    if n <= window:
        return entry
    keys = entry[3][-window:] if len(entry) > 3 else table[entry[2], n - window:n]
    return (window, entry[1], entry[2], keys)


# ---------------------------------------------------------------------- sinks, soft-capping
def attend_math(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None, scale: float, sinks: torch.Tensor | None,
                softcap: float | None, causal: bool = False) -> torch.Tensor:
    """q [B, Hq, Lq, D], keys / values [B, Hkv, Lk, D] (query head h reads KV head
    h // (Hq / Hkv)), mask broadcastable to [B, Hq, Lq, Lk], bool (True = visible) or
    additive -> [B, Hq, Lq, D] in q's dtype. fp32 inside, as transformers' eager softmax."""
    hq, hkv = q.shape[1], keys.shape[1]
    if hq != hkv:
        keys = keys.repeat_interleave(hq // hkv, dim=1)
        values = values.repeat_interleave(hq // hkv, dim=1)
    s = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if causal:
        lq, lk = s.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq)
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    elif mask is not None:  # additive (a windowed band)
        s = s + mask.float()
    if sinks is not None:
        # the sink's logit joins each row's denominator; its value is zero (column dropped)
        sink = sinks.float().view(1, hq, 1, 1).expand(s.shape[0], hq, s.shape[2], 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return torch.matmul(p, values.float()).to(q.dtype)


def forward_math(backend: "TorchNativeAttnBackend", layer: int, meta: TorchNativeMeta,
                 q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """A layer with sinks / soft-capping: every piece of its plan through attend_math, or
    under deterministic inference its kernel pieces through the paged decode kernel."""
    out = q.new_empty(q.shape[0], backend.num_heads * backend.head_dim)
    kernel_sinks = None
    if backend.deterministic and sinks is not None:
        kernel_sinks = sinks.detach().float().contiguous()  # the kernel reads fp32 logits
    for p in meta.pieces:
        if backend.deterministic and p.kind == "kernel":
            res = backend.run_piece(layer, p, q, k, v, kernel_sinks, softcap or 0.0)
        else:
            res = piece_math(backend, layer, p, q, k, v, sinks, softcap)
        if p.tok_idx is None:
            out[p.lo:p.hi] = res
        else:
            out.index_copy_(0, p.tok_idx, res)
    return out


def _kernel_keys(p: Piece, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel piece's per-query key slots padded to the longest: (slots [n, L], visible
    [n, 1, 1, L]); made once a forward (kept on the piece)."""
    if p.math_keys is None:
        starts = p.starts[:p.n]
        ends = p.ends if p.ends is not None else p.starts[1:p.n + 1]
        lens = ends - starts
        longest = int(lens.max())
        ar = torch.arange(longest)
        visible = ar[None, :] < lens[:, None]
        slots = p.slots[torch.where(visible, starts[:, None] + ar[None, :], 0)]
        p.math_keys = (slots.to(device), visible[:, None, None].to(device))
    return p.math_keys


def piece_math(backend: "TorchNativeAttnBackend", layer: int, p: Piece, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
               softcap: float | None) -> torch.Tensor:
    """One piece with sinks / soft-capping: [its tokens, Hq * D]."""
    hq, hkv, d = backend.num_heads, backend.num_kv_heads, backend.head_dim
    scale = backend.scale
    if p.kind in ("kernel", "decode"):
        qg = q[p.lo:p.hi] if p.tok_idx is None else q.index_select(0, p.tok_idx)
        if p.kind == "kernel":
            slots, mask = _kernel_keys(p, q.device)
            flat = slots.reshape(-1)
            pool, li = backend.kv_of(layer)
            keys = pool.k(li).index_select(0, flat).to(q.dtype)
            values = pool.v(li).index_select(0, flat).to(q.dtype)
        else:
            keys, values = backend.gather_kv(layer, p.kv_idx, p.unit, q.dtype)
            mask = p.mask
        keys = keys.view(p.n, -1, hkv, d).transpose(1, 2)          # [n, Hkv, L, D]
        values = values.view(p.n, -1, hkv, d).transpose(1, 2)
        out = attend_math(qg.reshape(p.n, hq, 1, d), keys, values, mask, scale, sinks,
                          softcap)
        return out.reshape(p.n, hq * d)
    n = p.hi - p.lo
    qr = q[p.lo:p.hi].transpose(0, 1)[None]                       # [1, Hq, n, D]
    if p.kind == "fresh":
        klo = p.lo if p.key_lo < 0 else p.key_lo
        keys, values = k[klo:p.hi], v[klo:p.hi]
    else:
        keys, values = backend.gather_kv(layer, p.kv_idx, p.unit, q.dtype)
    out = attend_math(qr, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], p.mask,
                      scale, sinks, softcap, causal=p.kind == "fresh" and p.mask is None)
    return out[0].transpose(0, 1).reshape(n, hq * d)
