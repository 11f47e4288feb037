"""Paged attention in plain torch (CPU and CUDA alike): scaled_dot_product_attention over K/V
gathered through req_to_token.

Per step (once, not per layer) we build:
  kv_idx  [B * S]      slot of key position j of request b (S = longest context in batch);
  mask    [B, 1, Q, S]  key j visible to new query i of b iff j <= start_b + i (causal; this
                        also hides the padding past b's own context); None when not needed;
  pad_dst [T]           where each flat token goes in the padded [B * Q] query layout
                        (None for decode, where Q = 1 and the layout is already [B]).
Per layer: write the new K/V at their slots, gather K and V for all requests (one
index_select each over the layer's contiguous [slots, H * D] rows -- measured ~10x faster
on CPU than advanced indexing of the (2, slots, H, D) view), and run ONE SDPA call for the
whole batch.
Decode therefore costs a fixed handful of ops per layer whatever the batch size.
GQA is handled by SDPA's enable_gqa (query head h uses KV head h // (Hq / Hkv), as in HF).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstrata.kv.device_pool import MHATokenToKVPool
from kvstrata.kv.req_to_token import ReqToTokenTable
from kvstrata.runner.forward_batch import ForwardBatch


@dataclass
class TorchNativeMeta:
    kv_idx: torch.Tensor | None       # [B * S] flattened; None: attend to the fresh K/V
    mask: torch.Tensor | None         # [B, 1, Q, S] bool
    pad_dst: torch.Tensor | None      # [T]
    max_q: int
    # True when the batch is one request starting at position 0: its keys are exactly the
    # new tokens, so we attend to the fresh K/V with is_causal and skip the gather.
    fresh_causal: bool


class TorchNativeAttnBackend:
    def __init__(self, kv_pool: MHATokenToKVPool | None, req_to_token: ReqToTokenTable | None,
                 num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.gqa = num_heads != num_kv_heads

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        b = fb.num_reqs
        if fb.out_slots is None or (b == 1 and fb.start_pos[0] == 0):
            if b != 1:
                raise ValueError("a no-cache forward takes exactly one request")
            fb.attn_meta = TorchNativeMeta(None, None, None, fb.q_lens[0], True)
            return
        kv_lens = [s + n for s, n in zip(fb.start_pos, fb.q_lens)]
        max_kv = max(kv_lens)
        max_q = max(fb.q_lens)
        rows = torch.tensor(fb.rows, dtype=torch.int64).to(device)
        kv_idx = self.req_to_token.table[rows, :max_kv].reshape(-1)
        key_pos = torch.arange(max_kv, device=device)
        if max_q == 1:
            pad_dst = None
            # Decode: only the length differs between requests; no mask if all equal.
            if min(kv_lens) == max_kv:
                mask = None
            else:
                lens = torch.tensor(kv_lens, dtype=torch.int64).to(device)
                mask = (key_pos[None, :] < lens[:, None])[:, None, None, :]
        else:
            starts = torch.tensor(fb.start_pos, dtype=torch.int64).to(device)
            q_pos = starts[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, Q]
            mask = (key_pos[None, None, :] <= q_pos[:, :, None])[:, None]         # [B,1,Q,S]
            dst: list[int] = []
            for i, n in enumerate(fb.q_lens):
                dst.extend(range(i * max_q, i * max_q + n))
            pad_dst = torch.tensor(dst, dtype=torch.int64).to(device)
        fb.attn_meta = TorchNativeMeta(kv_idx, mask, pad_dst, max_q, False)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (already rotated) -> attention output [T, Hq * D]."""
        meta: TorchNativeMeta = fb.attn_meta
        t = q.shape[0]
        if fb.out_slots is not None:
            self.kv_pool.set_kv(layer, fb.out_slots, k, v)
        if meta.fresh_causal:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=self.gqa)       # [Hq, T, D]
            return out.transpose(0, 1).reshape(t, -1)

        b, max_q = fb.num_reqs, meta.max_q
        hkv, d = self.num_kv_heads, self.head_dim
        k_all = self.kv_pool.k(layer).view(-1, hkv * d)
        v_all = self.kv_pool.v(layer).view(-1, hkv * d)
        keys = k_all.index_select(0, meta.kv_idx).view(b, -1, hkv, d).transpose(1, 2)
        values = v_all.index_select(0, meta.kv_idx).view(b, -1, hkv, d).transpose(1, 2)
        if meta.pad_dst is None:
            qp = q.view(b, 1, self.num_heads, self.head_dim)
        else:
            qp = q.new_zeros(b * max_q, self.num_heads, self.head_dim)
            qp.index_copy_(0, meta.pad_dst, q)
            qp = qp.view(b, max_q, self.num_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=meta.mask,
            scale=self.scale, enable_gqa=self.gqa)                         # [B, Hq, Q, D]
        out = out.transpose(1, 2).reshape(b * max_q, self.num_heads * self.head_dim)
        if meta.pad_dst is not None:
            out = out.index_select(0, meta.pad_dst)
        return out
