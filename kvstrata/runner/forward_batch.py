"""One forward pass worth of tokens, flattened across requests.

All requests' new tokens form one [T] stream (request after request, in batch order), so every
linear layer runs as one matmul over the whole batch; only attention needs per-request
structure, which the attention backend derives once per step into `attn_meta`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64, absolute position of each token
    token_rows: torch.Tensor         # [T] int64, req_to_token row of each token
    # [T] int64 KV slot of each new token; None = no-cache forward (KV is not stored).
    out_slots: torch.Tensor | None
    rows: list[int]                  # req_to_token row per request
    start_pos: list[int]             # tokens already in the cache per request
    q_lens: list[int]                # new tokens per request
    # Flat token indices whose logits are wanted (e.g. last token of each sampled request).
    logits_idx: torch.Tensor | None = None
    attn_meta: Any = field(default=None, repr=False)
    # Speculative draft trees: batch index -> parent of each of the entry's tokens (-1 for
    # its first token, then entry indices). Each token attends to the request's context
    # before the entry and its own ancestors; `positions` hold start + depth.
    trees: dict[int, list[int]] | None = None
    # Every token a one-token query over its own key slots (a draft model's tree step:
    # the context and the node's ancestors); out_slots are then scratch slots.
    query_keys: list[torch.Tensor] | None = None
    # DSA: the KV slots [T, width] each token attends to, decided before the forward (an MTP
    # draft's IndexShare, or the PD seed); the indexer does not run for such a forward.
    dsa_forced_slots: torch.Tensor | None = None
    dsa_forced_rows: torch.Tensor | None = None  # [T] bool: which tokens (None: all)
    # Hybrid SWA memory: [T] the SWA pool slot of each new token (its windowed layers write
    # there; out_slots stays the full pool's); None without an SWA pool.
    swa_out_slots: torch.Tensor | None = None
    # Recurrent (SSM / linear-attention) layers: each request's state slot and how its
    # recurrence runs this step (runner/recurrent/backend.py RecurrentMeta); None = no state
    # pool behind this forward (every request from a zero state, nothing kept).
    recurrent: Any = field(default=None, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, token_ids: list[list[int]], rows: list[int], start_pos: list[int],
              device: torch.device, out_slots: torch.Tensor | None = None) -> "ForwardBatch":
        flat: list[int] = []
        pos: list[int] = []
        tok_rows: list[int] = []
        for ids, s, row in zip(token_ids, start_pos, rows):
            flat.extend(ids)
            pos.extend(range(s, s + len(ids)))
            tok_rows.extend([row] * len(ids))
        # One host->device copy for all three index vectors.
        packed = torch.tensor([flat, pos, tok_rows], dtype=torch.int64).to(device)
        return cls(input_ids=packed[0], positions=packed[1], token_rows=packed[2],
                   out_slots=out_slots,
                   rows=list(rows), start_pos=list(start_pos),
                   q_lens=[len(t) for t in token_ids])


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each entry token (0 for the first) from its parent list."""
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def tree_ancestors(parents: list[int]) -> list[list[int]]:
    """Per entry token: its ancestors and itself, as entry indices in increasing order."""
    out: list[list[int]] = []
    for j, p in enumerate(parents):
        out.append((out[p] if p >= 0 else []) + [j])
    return out


def apply_trees(fb: ForwardBatch, trees: dict[int, list[int]]) -> None:
    """Rotary positions of tree entries: start + depth (slots stay start + index)."""
    if not trees:
        return
    offsets = [0]
    for n in fb.q_lens:
        offsets.append(offsets[-1] + n)
    pos = fb.positions.clone()
    for i, parents in trees.items():
        depths = torch.tensor(tree_depths(parents), dtype=torch.int64)
        pos[offsets[i]:offsets[i + 1]] = fb.start_pos[i] + depths.to(pos.device)
    fb.positions = pos
    fb.trees = trees


def write_swa_slots(swa_req_to_token, reqs, fb: ForwardBatch) -> None:
    """Hybrid SWA memory: each request's SWA slots into the SWA table (same positions as
    `slots`), and the new tokens' SWA slots, where the windowed layers write."""
    for r in reqs:
        if r.swa_slots is None or len(r.swa_slots) != len(r.slots):
            raise ValueError(f"request {r.rid!r}: the KV plan has an SWA pool, so every "
                             f"scheduled request needs swa_slots beside its "
                             f"{len(r.slots)} slots, got {r.swa_slots!r:.80}")
    swa_req_to_token.write_many([r.row for r in reqs], [r.slot_write_start for r in reqs],
                                [r.swa_slots for r in reqs])
    fb.swa_out_slots = swa_req_to_token.table[fb.token_rows, fb.positions]
