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
