"""Dense MLA attention in plain torch over the MLA pool (DeepSeek-V2 / V3: no DSA indexer).

Attention runs in the latent space, as in dsa_sparse.py: the model folds kv_b_proj's key half
into the query, so a query [H, R + r] dots the cached latent [R + r] of every earlier token of
its request directly, and the output is a latent [H, R] that the model expands with the
value half. The pool keeps one latent row per token for all heads (what makes MLA's KV small).

Per step, `init_forward_metadata` cuts the batch into one group per multi-token request
(its keys gathered once, a causal mask by position) and one padded group of all decode
tokens (each reading its request's slots up to its position). A no-cache forward (one
request, nothing stored) reads the fresh latents through an identity table. With
`deterministic` (--enable-deterministic-inference) every token instead runs as one query of
the paged decode kernel over its own keys (mla_fixed.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.kv.device_pool import MLATokenToKVPool
from kvstrata.kv.req_to_token import ReqToTokenTable
from kvstrata.runner.attention import mla_fixed
from kvstrata.runner.forward_batch import ForwardBatch


def attend_slots(q: torch.Tensor, latents: torch.Tensor, slots: torch.Tensor, scaling: float,
                 kv_lora_rank: int) -> torch.Tensor:
    """q [T, H, R + r] over the latents at `slots` [T, width] (-1: padding) -> [T, H, R]."""
    t, width = slots.shape
    keys = latents.index_select(0, slots.clamp(min=0).reshape(-1)).view(t, width, -1)
    scores = torch.bmm(q, keys.transpose(1, 2)) * scaling                   # [T, H, width]
    scores = scores.masked_fill((slots < 0)[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, keys[..., :kv_lora_rank])                       # [T, H, R]


def request_slot_table(fb: ForwardBatch, req_to_token: ReqToTokenTable | None
                       ) -> torch.Tensor:
    """Slots by (request row, position): the req_to_token table or, for a no-cache forward
    (one request, nothing stored), one identity row over its fresh tokens."""
    if fb.out_slots is not None:
        return req_to_token.table
    if fb.num_reqs != 1:
        raise ValueError("a no-cache forward takes exactly one request")
    return torch.arange(fb.num_tokens, device=fb.input_ids.device)[None, :]


@dataclass
class PrefillGroup:
    lo: int                       # flat tokens lo..hi of one request
    hi: int
    keys: torch.Tensor            # [S] slots of its positions 0..S-1 (S = start + n)
    start: int                    # position of token lo


@dataclass
class MLAMeta:
    prefills: list[PrefillGroup]
    decode_idx: torch.Tensor | None  # flat tokens of the one-token requests
    decode_slots: torch.Tensor | None  # [B, width] their visible slots, -1 padded
    no_cache: bool


class MLADenseBackend:
    def __init__(self, kv_pool: MLATokenToKVPool | None, req_to_token: ReqToTokenTable | None,
                 kv_lora_rank: int, scaling: float, deterministic: bool = False):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.kv_lora_rank = kv_lora_rank
        self.scaling = scaling
        self.deterministic = deterministic  # every token through the paged decode kernel

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.trees is not None or fb.query_keys is not None:
            raise NotImplementedError("not implemented yet: speculative draft trees over "
                                      "dense MLA attention")
        device = fb.input_ids.device
        no_cache = fb.out_slots is None
        table = request_slot_table(fb, self.req_to_token)
        if self.deterministic:
            fb.attn_meta = mla_fixed.ranges_meta(fb, table, no_cache)
            return
        prefills: list[PrefillGroup] = []
        decode: list[tuple[int, int, int]] = []   # (flat token, row, visible length)
        off = 0
        for row, start, n in zip(fb.rows, fb.start_pos, fb.q_lens):
            if n == 1 and not no_cache:
                decode.append((off, row, start + 1))
            else:
                prefills.append(PrefillGroup(off, off + n, table[0 if no_cache else row,
                                                                 :start + n], start))
            off += n
        idx = slots = None
        if decode:
            packed = torch.tensor(decode, dtype=torch.int64).T.to(device)
            width = max(d[2] for d in decode)
            slots = table[packed[1], :width].masked_fill(
                torch.arange(width, device=device)[None, :] >= packed[2][:, None], -1)
            idx = packed[0]
        fb.attn_meta = MLAMeta(prefills, idx, slots, no_cache)

    def forward(self, layer: int, q: torch.Tensor, latent: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, H, R + r] (absorbed, rotated), latent [T, R + r] -> [T, H, R]."""
        meta = fb.attn_meta
        if self.deterministic:
            if not meta.no_cache:
                self.kv_pool.set_latent(layer, fb.out_slots, latent)
            rows = mla_fixed.latent_rows(self.kv_pool, layer, latent, meta.no_cache)
            return mla_fixed.attend(q, rows, meta.slots, meta.begins, self.scaling,
                                    self.kv_lora_rank, ends=meta.ends)
        if meta.no_cache:
            latents = latent
        else:
            self.kv_pool.set_latent(layer, fb.out_slots, latent)
            latents = self.kv_pool.latent[layer]
        out = q.new_empty(*q.shape[:2], self.kv_lora_rank)
        for g in meta.prefills:
            keys = latents.index_select(0, g.keys)                             # [S, R + r]
            qg = q[g.lo:g.hi]
            scores = torch.matmul(qg, keys.T) * self.scaling                   # [n, H, S]
            pos = torch.arange(g.start, g.start + qg.shape[0], device=q.device)
            hidden = torch.arange(keys.shape[0], device=q.device)[None, :] > pos[:, None]
            scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[g.lo:g.hi] = torch.matmul(probs, keys[:, :self.kv_lora_rank])
        if meta.decode_idx is not None:
            out.index_copy_(0, meta.decode_idx,
                            attend_slots(q.index_select(0, meta.decode_idx), latents,
                                         meta.decode_slots, self.scaling, self.kv_lora_rank))
        return out
