"""DeepSeek sparse attention (DSA) helpers that a decode server needs before the model lands.

A prefill server sends, per request, the indexer's top-k *positions* (request-relative) as the
seed of the first decode step. Positions mean nothing on the decode server; its KV slots do.
The remap turns positions into decode-local slots through req_to_token, and fails closed: a
row that contains anything suspicious becomes all -1 (no seed) rather than pointing attention
at someone else's KV.
"""
from __future__ import annotations

import torch


def remap_seed_positions_to_slots(seeds: torch.Tensor, req_to_token: torch.Tensor,
                                  req_pool_indices: torch.Tensor,
                                  seq_lens: torch.Tensor) -> torch.Tensor:
    """seeds [B, topk] int (-1 = padding) -> slots [B, topk] (-1 kept where the seed was -1).

    A row becomes all -1 when it holds a value < -1, a position >= its seq_len or >= the
    table width, or a valid position whose slot is <= 0 (row 0 / slot 0 mean unallocated)."""
    if seeds.dim() != 2:
        raise ValueError(f"seeds must be [batch, topk], got shape {tuple(seeds.shape)}")
    seeds = seeds.to(torch.long)
    rows = req_pool_indices.to(torch.long).view(-1, 1)
    lens = seq_lens.to(torch.long).view(-1, 1)
    width = req_to_token.shape[1]
    valid = seeds >= 0
    bad = (seeds < -1) | (valid & ((seeds >= lens) | (seeds >= width))) | (rows <= 0)
    safe_pos = torch.where(valid & ~bad, seeds, torch.zeros_like(seeds))
    slots = req_to_token[rows.expand_as(seeds), safe_pos].to(torch.long)
    bad |= valid & (slots <= 0)
    row_bad = bad.any(dim=1, keepdim=True)
    out = torch.where(valid, slots, torch.full_like(slots, -1))
    return torch.where(row_bad, torch.full_like(out, -1), out)


def batch_seed(seeds: torch.Tensor | None) -> torch.Tensor | None:
    """The batch uses a seed only if every row has one: a row that is entirely negative
    (no seed, or failed closed) turns the seed off for the whole batch (None)."""
    if seeds is None or seeds.numel() == 0:
        return None
    if bool((seeds < 0).all(dim=1).any()):
        return None
    return seeds


def seed_for_decode(seeds: torch.Tensor, req_to_token: torch.Tensor,
                    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    remap_enabled: bool) -> torch.Tensor | None:
    """Apply the resolved gate (`dsa_remap_pd_seed_to_local_slots`): remap when on, pass the
    positions through unchanged when off; then the batch-level rule."""
    if remap_enabled:
        seeds = remap_seed_positions_to_slots(seeds, req_to_token, req_pool_indices, seq_lens)
    return batch_seed(seeds)
