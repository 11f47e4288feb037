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


def checked_seeds(seeds: torch.Tensor, req_to_token: torch.Tensor,
                  req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                  remap_enabled: bool) -> torch.Tensor:
    """Apply the resolved gate (`dsa_remap_pd_seed_to_local_slots`): slots when on,
    positions when off; either way a row with an invalid entry fails closed to all -1 (the
    positions path maps through req_to_token later: it must not read a stranger's slot)."""
    slots = remap_seed_positions_to_slots(seeds, req_to_token, req_pool_indices, seq_lens)
    if remap_enabled:
        return slots
    failed = (slots < 0).all(dim=1, keepdim=True) & (seeds >= 0).any(dim=1, keepdim=True)
    return torch.where(failed, torch.full_like(seeds, -1), seeds.to(torch.long))


def seed_for_decode(seeds: torch.Tensor, req_to_token: torch.Tensor,
                    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    remap_enabled: bool) -> torch.Tensor | None:
    """checked_seeds, then the batch-level rule."""
    return batch_seed(checked_seeds(seeds, req_to_token, req_pool_indices, seq_lens,
                                    remap_enabled))


def slots_to_positions(slots: torch.Tensor, row_slots: torch.Tensor, topk: int) -> list[int]:
    """A query's selected KV slots [width] (-1 padded) -> request positions through its
    req_to_token row `row_slots` [length] (the inverse of the unfused mapping), -1 padded to
    `topk`. All -1 if a slot is not in the row (the seed is then absent, never wrong)."""
    match = slots[:, None] == row_slots[None, :]
    valid = slots >= 0
    if not bool((match.any(dim=1) | ~valid).all()):
        return [-1] * topk
    positions = torch.where(valid, match.to(torch.int8).argmax(dim=1), -1).tolist()
    return positions + [-1] * (topk - len(positions))


class DSASeedKeeper:
    """The runner's half of the PD seed (sglang-behaviour.md 5.2/5.3).

    Prefill: `seed_of` turns the last layer's selection for a request's last prompt token
    into positions for the transfer metadata. Decode: requests arrive with wire positions;
    on their first scheduled step (their req_to_token rows are written) the batch of them is
    remapped or passed through per the resolved gate and kept per request (`seeds`) for the
    consumer (IndexShare draft, a later issue); the target's attention never reads it.
    `records` (bounded) is a debug view: the latent rows the seed points at, per side."""

    MAX_RECORDS = 64

    def __init__(self, topk: int, remap: bool):
        self.topk = topk
        self.remap = remap
        self.pending: dict[str, list[int]] = {}        # rid -> wire positions
        self.seeds: dict[str, torch.Tensor | None] = {}  # rid -> kept seed row
        # rid -> "used" (kept) | "failed_closed" (an invalid entry) | "recomputed" (no seed,
        # or the batch rule turned it off): what its first draft round's attention starts from
        self.outcomes: dict[str, str] = {}
        self.records: list[dict] = []

    def forget(self, rid: str) -> None:
        self.pending.pop(rid, None)
        self.seeds.pop(rid, None)
        self.outcomes.pop(rid, None)

    def take(self, rid: str, row_slots: torch.Tensor) -> tuple[torch.Tensor | None, str]:
        """The consumer (an MTP draft's first round): the request's seed as KV slots (the
        remapped row, or its positions mapped through `row_slots`, its req_to_token row)
        and the outcome; the seed is gone afterwards (it feeds one draft round)."""
        seed = self.seeds.pop(rid, None)
        outcome = self.outcomes.pop(rid, "recomputed")
        if seed is None:
            return None, outcome
        if not self.remap:
            seed = torch.where(seed >= 0, row_slots[seed.clamp(min=0)].to(torch.long), -1)
        return seed, outcome

    def _record(self, rec: dict) -> None:
        self.records.append(rec)
        del self.records[:-self.MAX_RECORDS]

    # `latents`: the pool's per-slot rows of every layer, (L, slots, latent + index_k).
    def seed_of(self, selected: torch.Tensor, row_slots: torch.Tensor,
                latents: torch.Tensor) -> list[int]:
        positions = slots_to_positions(selected, row_slots, self.topk)
        valid = [p for p in positions if p >= 0]
        self._record({"side": "prefill", "positions": positions,
                      "latent": latents.index_select(1, row_slots[valid]).tolist()})
        return positions

    def prefill_seeds(self, reqs, selected: torch.Tensor, prompt_len_of, table: torch.Tensor,
                      latents: torch.Tensor) -> dict[str, list[int]]:
        """The last layer's top-k (`selected`, the forward's [T, width] slots) of each request
        whose last prompt token ran, as positions."""
        seeds, offset = {}, 0
        for r in reqs:
            offset += len(r.token_ids)
            end = r.start_pos + len(r.token_ids)
            if r.sample and end == prompt_len_of(r.rid):
                seeds[r.rid] = self.seed_of(selected[offset - 1], table[r.row, :end], latents)
        return seeds

    def apply_pending(self, reqs: list, table: torch.Tensor, latents: torch.Tensor) -> None:
        """Remap (or pass through) the wire seeds of the scheduled requests that have one."""
        batch = [r for r in reqs if r.rid in self.pending]
        if not batch:
            return
        wire = [self.pending.pop(r.rid) for r in batch]
        device = table.device
        seeds = torch.tensor(wire, dtype=torch.int64, device=device)
        rows = torch.tensor([r.row for r in batch], dtype=torch.int64, device=device)
        # The committed context: the entry's first token (a verify entry's drafts follow it).
        lens = torch.tensor([r.start_pos + 1 for r in batch], device=device)
        checked = checked_seeds(seeds, table, rows, lens, self.remap)
        kept = batch_seed(checked)
        for i, r in enumerate(batch):
            seed = None if kept is None else kept[i]
            self.seeds[r.rid] = seed
            failed = bool((checked[i] < 0).all()) and bool((seeds[i] >= 0).any())
            self.outcomes[r.rid] = ("used" if seed is not None else
                                    "failed_closed" if failed else "recomputed")
            # The decode-local slot of each wire position: the seed itself when remapped,
            # else the slot the unfused path would map the position to.
            pos = torch.tensor([p for p in wire[i] if 0 <= p < int(lens[i])], dtype=torch.int64,
                               device=device)
            slots = (seed[seed >= 0] if (seed is not None and self.remap)
                     else table[rows[i], pos])
            self._record({"side": "decode", "positions": wire[i], "remapped": self.remap,
                          "seed": None if seed is None else seed.tolist(),
                          "latent": latents.index_select(1, slots).tolist()})
