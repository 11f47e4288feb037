"""DSA sparse MLA attention in plain torch over the MLA + indexer pool.

Per layer: the new tokens' latent vectors and indexer keys go to their slots; the lightning
indexer scores every query token against its request's earlier tokens (indexer keys read
through req_to_token); top-k picks at most `index_topk` of them as KV slots (fused or
unfused, attention/dsa_topk.py); attention then reads only those slots' latents.

Attention runs in the latent space ("weight absorption", as SGLang's sparse MLA kernels do):
the model folds kv_b_proj's key half into the query, so a query [H, R + r] dots the cached
latent [R + r] directly and the output stays a latent [H, R] that the model expands with the
value half. Cost per query token: topk gathered rows, whatever the context length -- which is
what sparsity buys (the dense path, `dense=True`, reads every earlier token instead).

Indexer score of key j for a query (the reference's arithmetic, float32):
    sum_h weights[h] * relu(q_h . k_j * index_head_dim^-0.5)
weights = weights_proj(x) * index_n_heads^-0.5 (computed by the model).

Per step, `init_forward_metadata` cuts the batch into groups: one per multi-token request
(its keys are gathered once for all its queries) and one padded group for all decode
tokens. A no-cache forward (one request, nothing stored) reads the fresh tensors instead of
the pool, through an identity table. `deterministic` (--enable-deterministic-inference): the
indexer's scores in one summation order, a stable top-k and each query's attention in the
paged decode kernel over its own selected slots (mla_fixed.py), whatever its group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.kv.device_pool import MLATokenToKVPool
from kvstrata.kv.req_to_token import ReqToTokenTable
from kvstrata.runner.attention import mla_fixed
from kvstrata.runner.attention.dsa_topk import (fused_topk_to_slots, positions_to_slots,
                                               topk_positions)
from kvstrata.runner.attention.mla_dense import attend_slots, request_slot_table
from kvstrata.runner.forward_batch import ForwardBatch


@dataclass
class IndexGroup:
    """Query tokens that share one indexer-score matrix [n, S]."""
    tok_idx: torch.Tensor | None  # flat tokens of a decode group; None = lo..hi
    lo: int
    hi: int
    keys_table: torch.Tensor      # [1 or n, S] slots of keys 0..S-1 (page table, size 1)
    lengths: torch.Tensor         # [n] keys visible to each query (position + 1)
    rows: torch.Tensor            # [n] req_to_token row of each query (unfused mapping)


@dataclass
class DSAMeta:
    groups: list[IndexGroup]
    width: int                    # slots per query: min(topk, longest visible length)
    table: torch.Tensor           # what unfused positions map through (req_to_token)
    no_cache: bool


class DSASparseMLABackend:
    def __init__(self, kv_pool: MLATokenToKVPool | None, req_to_token: ReqToTokenTable | None,
                 kv_lora_rank: int, index_topk: int, index_head_dim: int, scaling: float,
                 fused_topk: bool = True, dense: bool = False, deterministic: bool = False):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.kv_lora_rank = kv_lora_rank
        self.index_topk = index_topk
        self.index_scale = index_head_dim ** -0.5
        self.scaling = scaling
        self.fused_topk = fused_topk
        self.dense = dense  # every earlier token: the dense MLA baseline (benchmarks)
        self.deterministic = deterministic  # one summation order per query (mla_fixed.py)
        # Slots [T, width] each layer selected in the last forward (tests and the PD seed).
        self.last_selected: list[torch.Tensor] = []

    # ------------------------------------------------------------------ per step
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.input_ids.device
        no_cache = fb.out_slots is None
        table = request_slot_table(fb, self.req_to_token)
        groups: list[IndexGroup] = []
        decode: list[tuple[int, int, int]] = []   # (flat token, row, visible length)
        off, longest = 0, 1
        for row, start, n in zip(fb.rows, fb.start_pos, fb.q_lens):
            longest = max(longest, start + n)
            if n == 1 and not no_cache:
                decode.append((off, row, start + 1))
            else:
                row_t = torch.zeros(n, dtype=torch.int64, device=device) + (0 if no_cache
                                                                           else row)
                lengths = torch.arange(start + 1, start + n + 1, device=device)
                keys = table[row_t[:1], :start + n]
                groups.append(IndexGroup(None, off, off + n, keys, lengths, row_t))
            off += n
        if decode:
            packed = torch.tensor([[d[0] for d in decode], [d[1] for d in decode],
                                   [d[2] for d in decode]], dtype=torch.int64).to(device)
            width = max(d[2] for d in decode)
            toks = [d[0] for d in decode]
            contiguous = toks == list(range(toks[0], toks[0] + len(toks)))
            groups.append(IndexGroup(None if contiguous else packed[0], toks[0],
                                     toks[0] + len(toks), table[packed[1], :width],
                                     packed[2], packed[1]))
        width = longest if self.dense else min(self.index_topk, longest)
        fb.attn_meta = DSAMeta(groups, width, table, no_cache)
        self.last_selected = []

    # ------------------------------------------------------------------ per layer
    def forward(self, layer: int, q: torch.Tensor, latent: torch.Tensor,
                index_q: torch.Tensor, index_k: torch.Tensor, index_weights: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """q [T, H, R + r] (absorbed, rotated), latent [T, R + r], index_q [T, Hi, Di],
        index_k [T, Di], index_weights [T, Hi] -> attention output in latent space [T, H, R]."""
        meta: DSAMeta = fb.attn_meta
        if meta.no_cache:
            latents, index_keys = latent, index_k
        else:
            self.kv_pool.set_latent(layer, fb.out_slots, latent, index_k)
            latents, index_keys = self.kv_pool.latent[layer], self.kv_pool.index_k[layer]
        slots = fb.dsa_forced_slots
        if slots is None or fb.dsa_forced_rows is not None:
            chosen = self.select(meta, index_q, index_keys, index_weights)
            if slots is not None:  # forced rows keep their slots, the others the indexer's
                w = max(slots.shape[1], chosen.shape[1])
                slots = torch.where(fb.dsa_forced_rows[:, None],
                                    torch.nn.functional.pad(slots, (0, w - slots.shape[1]),
                                                            value=-1),
                                    torch.nn.functional.pad(chosen, (0, w - chosen.shape[1]),
                                                            value=-1))
            else:
                slots = chosen
        self.last_selected.append(slots)
        if self.deterministic:
            flat, starts = mla_fixed.compact_slots(slots)
            rows = mla_fixed.latent_rows(self.kv_pool, layer, latent, meta.no_cache)
            return mla_fixed.attend(q, rows, flat, starts, self.scaling, self.kv_lora_rank)
        return self.attend(q, latents, slots)

    def select(self, meta: DSAMeta, index_q: torch.Tensor, index_keys: torch.Tensor,
               index_weights: torch.Tensor) -> torch.Tensor:
        """[T, width] KV slots each query token attends to (-1 padded)."""
        out = torch.full((index_q.shape[0], meta.width), -1, dtype=torch.int64,
                         device=index_q.device)
        for g in meta.groups:
            if g.tok_idx is None:
                q, w = index_q[g.lo:g.hi], index_weights[g.lo:g.hi]
            else:
                q, w = index_q.index_select(0, g.tok_idx), index_weights.index_select(0, g.tok_idx)
            scores = self.index_scores(q, w, index_keys, g.keys_table)
            n = scores.shape[0]
            stable = self.deterministic
            if self.fused_topk:
                slots = fused_topk_to_slots(scores, g.lengths, g.keys_table.expand(n, -1),
                                            meta.width, stable)
            else:
                slots = positions_to_slots(topk_positions(scores, g.lengths, meta.width,
                                                          stable), meta.table, g.rows)
            if g.tok_idx is None:
                out[g.lo:g.hi] = slots
            else:
                out.index_copy_(0, g.tok_idx, slots)
        return out

    def index_scores(self, q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor,
                     keys_table: torch.Tensor) -> torch.Tensor:
        """q [n, Hi, Di], weights [n, Hi], keys_table [1 or n, S] -> scores [n, S] (float32)."""
        keys = index_keys.index_select(0, keys_table.reshape(-1)).view(
            *keys_table.shape, -1).float()                                    # [1|n, S, Di]
        if self.deterministic:
            return mla_fixed.ordered_index_scores(q, weights, keys, self.index_scale)
        dots = torch.matmul(q.float(), keys.transpose(-1, -2)) * self.index_scale  # [n, Hi, S]
        return torch.matmul(weights.float()[:, None, :], dots.relu())[:, 0]

    def attend(self, q: torch.Tensor, latents: torch.Tensor, slots: torch.Tensor
               ) -> torch.Tensor:
        return attend_slots(q, latents, slots, self.scaling, self.kv_lora_rank)
