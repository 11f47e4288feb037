"""The per-step plan of the torch-native backend (torch_native.py): its attention pieces.

Its own module so that window.py (sliding windows, sinks, soft-capping) builds pieces
without importing the backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Piece:
    kind: str                          # "fresh" | "paged" | "decode" | "kernel"
    lo: int                            # flat token range [lo, hi) (fresh / paged)
    hi: int
    kv_idx: torch.Tensor | None = None  # [n * S / unit] rows of `unit` slots (paged / decode)
    unit: int = 1                       # slots per gathered row: 1, or page_size (see kv_index)
    mask: torch.Tensor | None = None    # bool, broadcastable to SDPA scores; None = all visible
    tok_idx: torch.Tensor | None = None  # [n] flat tokens of a decode group; None = lo..hi
    n: int = 0                         # requests in a decode group
    slots: torch.Tensor | None = None   # kernel: every request's slots, concatenated
    starts: torch.Tensor | None = None  # kernel: [n + 1] offsets of each request in `slots`
    ends: torch.Tensor | None = None    # kernel, ranges: [n] ends (starts then has n entries)
    row: int = -1                       # fresh / causal paged: the request's req_to_token row
    prefix: int = -1                    # ... and its cached tokens (0: fresh); -1: a tree
    decode_call: Any = None             # kernel: paged_decode.DecodeCall, made at layer 0
    key_lo: int = -1                    # fresh: first flat key (-1: lo); a windowed block's
    math_keys: Any = None               # kernel, sinks / softcap: window._kernel_keys' cache
    fixed: bool = False                 # kernel: the prefill kernel's order (deterministic)


@dataclass
class TorchNativeMeta:
    pieces: list[Piece]
    # True when pieces cover the flat tokens exactly in order with one piece: its output is
    # the layer's output, no assembly copy.
    single: bool
    # The prompts the prefill kernel runs in one call a layer: (their pieces, their key
    # slots concatenated, (q_lo, q_hi, slot offset, prefix) each); None: SDPA for all.
    prefill: tuple | None = None
    # A model with sliding windows: each layer window's plan (key None: full causal); a
    # window no query of the step reaches past shares the full plan. None: no windows.
    by_window: dict | None = None
    # Every layer runs this plan (decode_plan.py replays one plan for all layers).
    uniform: bool = True
