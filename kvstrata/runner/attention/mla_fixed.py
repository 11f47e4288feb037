"""Deterministic inference for MLA and DSA attention (--enable-deterministic-inference on
DeepSeek-V2 / V3 / V3.2): one reduction order per query token, whatever the batch, the chunk
or where its keys came from.

Why: the plain backends (mla_dense.py, dsa_sparse.py) score a prompt's queries with one matmul
over its gathered keys and the decode tokens with one padded bmm, so a query's sums were
split and ordered by its group's shape -- a cached prefix, another chunk size or a longer
neighbour in the decode group changed its bits, and bf16 rounding turned that into other
tokens. Here:

  attention  every query token, prompt or decode, is one query of the paged decode kernel
             (paged_decode.py, as the MHA path runs it): one KV "head" whose rows are the
             pool's latent rows [R + r], read in place, used as keys and as values (the
             output's first R columns are MLA's latent output; the kernel also sums the r
             rope columns, which are dropped: r / (R + r) more value work). A DSA pool row
             also holds the indexer key after the latent: the query is zero-padded over it
             (adding 0 * key leaves every dot unchanged), so the kernel reads the pool's rows
             as they lie. A query's keys are summed in its own slot order, scored, normalised
             and weighted in fp32, whatever the other queries of the call.
  indexer    (DSA) each score sum_h w_h * relu(q_h . k * s): the dots q_h . k on kvstrata's
             fixed fp32 GEMM (packed_linear.PackedLinear._init_fixed) with the keys as its
             weight -- one k order per output whatever the rows (queries x heads), the number
             of key columns or a key's column (test_batch_invariance.py) -- then the heads
             summed in head order by fp32 elementwise multiplies and adds (IEEE correctly
             rounded: their bits cannot depend on the tensor around them); a matmul picks its
             blocking, and so a score's summation order, by the shape of the batch. Where the
             fixed GEMM does not run (an odd index_head_dim, a CPU without AVX2) the dots are
             built the same elementwise way, over the dims in order.
  top-k      (DSA) a stable descending sort (ties keep position order; dsa_topk.py `stable`):
             torch.topk breaks exact ties -- a score of 0 when every head's relu is 0 -- by
             its algorithm, which follows the row's width, and the width is the group's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.runner.attention.paged_decode import paged_decode
from kvstrata.runner.cpu.fixed_linear import fixed_unsupported
from kvstrata.runner.cpu.packed_linear import PackedLinear
from kvstrata.runner.forward_batch import ForwardBatch


@dataclass
class RangesMeta:
    """Every query token of a forward over its request's slot list: token t attends to
    slots[begins[t]:ends[t]] (its keys 0 .. its own position)."""
    slots: torch.Tensor    # int64, each request's slots 0 .. start + n - 1, concatenated
    begins: torch.Tensor   # [T] int64
    ends: torch.Tensor     # [T] int64
    no_cache: bool


def ranges_meta(fb: ForwardBatch, table: torch.Tensor, no_cache: bool) -> RangesMeta:
    """The forward's tokens (flat order) as ranges over their requests' slot lists; `table`:
    request_slot_table's (an identity row for a no-cache forward)."""
    slot_lists: list[torch.Tensor] = []
    begins: list[int] = []
    ends: list[int] = []
    off = 0
    for row, start, n in zip(fb.rows, fb.start_pos, fb.q_lens):
        slot_lists.append(table[0 if no_cache else row, :start + n])
        begins.extend([off] * n)
        ends.extend(range(off + start + 1, off + start + n + 1))
        off += start + n
    return RangesMeta(torch.cat(slot_lists).to(torch.int64).contiguous(),
                      torch.tensor(begins, dtype=torch.int64),
                      torch.tensor(ends, dtype=torch.int64), no_cache)


def latent_rows(kv_pool, layer: int, fresh_latent: torch.Tensor, no_cache: bool
                ) -> torch.Tensor:
    """[rows, 1, width] the kernel reads: the pool's rows of `layer` as they lie (latent,
    then a DSA pool's indexer key), or a no-cache forward's fresh latents."""
    if no_cache:
        return fresh_latent.contiguous().view(fresh_latent.shape[0], 1, -1)
    return kv_pool.kv[0, layer]


def attend(q: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
           scaling: float, kv_lora_rank: int, ends: torch.Tensor | None = None
           ) -> torch.Tensor:
    """q [T, H, R + r] (absorbed, rotated) over latent `rows` [N, 1, W >= R + r] at their
    slots (paged_decode's starts / ends) -> [T, H, R], each query by itself."""
    t, heads, width = q.shape
    pad = rows.shape[-1] - width
    q = torch.cat((q, q.new_zeros(t, heads, pad)), -1) if pad else q.contiguous()
    out = paged_decode(q, rows, rows, slots, starts, scaling, ends=ends)
    return out[..., :kv_lora_rank]


def compact_slots(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, width] slots (-1: none) -> (each row's slots in its order, concatenated; starts
    [T + 1]) for paged_decode."""
    valid = slots >= 0
    starts = torch.zeros(slots.shape[0] + 1, dtype=torch.int64)
    starts[1:] = valid.sum(dim=1).cumsum(0)
    return slots[valid].to(torch.int64).contiguous(), starts


def ordered_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """The indexer's scores q [n, Hi, Di], weights [n, Hi], keys [1 or n, S, Di] -> [n, S]
    float32, sum_h weights[h] * relu(q_h . k * scale), every sum in one order (module
    docstring): each dot on the fixed GEMM, then heads 0 .. Hi - 1."""
    q, keys, weights = q.float(), keys.float(), weights.float()
    act = (_dots(q, keys) * scale).relu()                                 # [n, Hi, S]
    scores = weights[:, 0, None] * act[:, 0]
    for h in range(1, act.shape[1]):
        scores = scores + weights[:, h, None] * act[:, h]
    return scores


def _dots(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [n, Hi, Di] . keys [1 or n, S, Di] -> [n, Hi, S] float32, each dot in one order."""
    n, heads, dim = q.shape
    if fixed_unsupported(keys[0]) is None:
        if keys.shape[0] == 1:  # a prompt's queries over one key list
            return PackedLinear(keys[0], fixed=True)(q.reshape(n * heads, dim)).view(
                n, heads, -1)
        return torch.stack([PackedLinear(keys[i], fixed=True)(q[i]) for i in range(n)])
    dots = q[:, :, None, 0] * keys[:, None, :, 0]
    for d in range(1, dim):
        dots = dots + q[:, :, None, d] * keys[:, None, :, d]
    return dots
