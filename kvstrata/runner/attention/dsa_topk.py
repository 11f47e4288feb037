"""DSA top-k selection in its two result domains (sglang-behaviour.md section 5.1).

Every query token t has indexer scores over the keys of its request, `scores[t, j]` for
request position j, of which the first `lengths[t]` are real (causal: a token at position p
sees p + 1 keys). Selection rule, the same in both domains:
  lengths[t] <= topk   the first lengths[t] positions, in order, then -1
  lengths[t] >  topk   the topk best-scoring positions among the first lengths[t]

  unfused  `topk_positions` -> request-relative positions, then `positions_to_slots` maps
           them to physical KV slots through req_to_token (two ops, positions in between:
           the domain a PD prefill server ships as the seed).
  fused    `fused_topk_to_slots`: scores -> slots in one op (-1 padded), shaped like
           sgl_kernel.fast_topk_transform_fused (score, lengths, page table with page size 1,
           topk) so a CUDA/HIP kernel can replace this torch version behind the same call.
Both must give the same slots; attention consumes slots either way. `stable`
(deterministic inference): the best by a stable descending sort -- equal scores in position
order, whatever the row's width (torch.topk breaks exact ties by its algorithm, which follows
the width: a decode group's, a prompt's).
"""
from __future__ import annotations

import torch


def _check(scores: torch.Tensor, lengths: torch.Tensor, topk: int) -> None:
    if scores.dim() != 2 or lengths.shape != scores.shape[:1]:
        raise ValueError(f"scores must be [N, S] with lengths [N], got {tuple(scores.shape)} "
                         f"and {tuple(lengths.shape)}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")


def _best(scores: torch.Tensor, lengths: torch.Tensor, topk: int,
          stable: bool = False) -> torch.Tensor:
    """[N, min(topk, S)] indices of the best scores among each row's first lengths[t]."""
    cols = torch.arange(scores.shape[1], device=scores.device)
    masked = scores.masked_fill(cols[None, :] >= lengths[:, None], float("-inf"))
    k = min(topk, scores.shape[1])
    if stable:
        return masked.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return masked.topk(k, dim=-1).indices


def topk_positions(scores: torch.Tensor, lengths: torch.Tensor, topk: int,
                   stable: bool = False) -> torch.Tensor:
    """Unfused step 1: [N, S] scores -> [N, topk] int64 request positions, -1 padded."""
    _check(scores, lengths, topk)
    n = scores.shape[0]
    lengths = lengths.to(torch.int64)
    first = torch.arange(topk, device=scores.device).expand(n, topk)
    first = torch.where(first < lengths[:, None], first, -1)
    best = _best(scores, lengths, topk, stable)
    picked = torch.full((n, topk), -1, dtype=torch.int64, device=scores.device)
    picked[:, :best.shape[1]] = best
    return torch.where((lengths <= topk)[:, None], first, picked)


def positions_to_slots(positions: torch.Tensor, req_to_token: torch.Tensor,
                       rows: torch.Tensor) -> torch.Tensor:
    """Unfused step 2: positions [N, K] of req_to_token rows `rows` [N] -> slots, -1 kept."""
    valid = positions >= 0
    slots = req_to_token[rows.to(torch.int64)[:, None], positions.clamp(min=0)]
    return torch.where(valid, slots.to(torch.int64), -1)


def fused_topk_to_slots(scores: torch.Tensor, lengths: torch.Tensor,
                        page_table_size_1: torch.Tensor, topk: int,
                        stable: bool = False) -> torch.Tensor:
    """Fused: [N, S] scores, lengths [N] and each query's page-size-1 table row [N, >= S]
    (req_to_token[row, :S]) -> [N, topk] int64 KV slots, -1 padded.

    Selects in score index space and gathers the table in the same op, the way the kernel
    writes dst[t][i] = page_table[t][topk_idx[t][i]] without materialising positions."""
    _check(scores, lengths, topk)
    n, s = scores.shape
    lengths = lengths.to(torch.int64)
    table = page_table_size_1[:, :s].to(torch.int64)
    out = torch.full((n, topk), -1, dtype=torch.int64, device=scores.device)
    width = min(topk, s)
    head = table[:, :width]
    short = lengths <= topk
    cols = torch.arange(width, device=scores.device)
    out[:, :width] = torch.where(
        short[:, None], torch.where(cols[None, :] < lengths[:, None], head, -1),
        torch.gather(table, 1, _best(scores, lengths, topk, stable)))
    return out
