"""The recurrent layers' backend: what the attention backend is to attention layers, over the
state pool (kv/state_pool.py) instead of the KV pool.

Once per step `RecurrentMeta.build` sorts the batch's requests by how their recurrence runs:
  decode   one-token rows, all of them through one batched step per layer (the conv window
           shift and the state update; the slots gathered, updated, scattered back)
  prefill  a multi-token chunk: the chunked conv and scan per request, the slot read as the
           initial state (zeros when start_pos is 0) and the final state written back; an
           interior snapshot (`snapshots`: the state after the first m tokens into another
           slot) splits the scan there
  verify   a speculative verify entry (its tokens are the last one and the drafts): run
           token by token from the slot, every step's state kept and the slot left alone;
           `commit(i, step)` writes the accepted step's state once acceptance is known
           (SGLang's intermediate states; rejected drafts are never written anywhere)
A forward without metadata (no state pool: a no-cache forward, a calibration pass) runs every
request from a zero state and keeps nothing.

Each recurrent layer calls `conv`, then `gated_delta` (Gated DeltaNet) or `ssd` (Mamba2), with
its index among the recurrent layers (the pool's layer index).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kvstrata.kv.state_pool import RecurrentStatePool
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.recurrent import fused_step
from kvstrata.runner.recurrent.conv import conv_chunk, conv_step
from kvstrata.runner.recurrent.gated_delta import (chunk_gated_delta, gated_delta_step,
                                                   gated_delta_steps)
from kvstrata.runner.recurrent.ssd import ssd_chunk_scan, ssd_step, ssd_steps


@dataclass
class RecurrentMeta:
    slots: list[int]          # per request: its working state slot (0: none, stateless)
    offsets: list[int]        # per request: its first token in the flat batch
    q_lens: list[int]
    has_state: list[bool]     # per request: the slot holds the state at start_pos
    verify: list[bool]        # per request: a speculative verify entry
    decode: list[int] = field(default_factory=list)   # request indices of one-token rows
    decode_tokens: torch.Tensor | None = None          # their tokens in the flat batch
    decode_slots: torch.Tensor | None = None
    # verify request index -> per pool layer the (conv concatenation, step states) a commit
    # reads (filled during the forward)
    pending: dict[int, dict[int, tuple]] = field(default_factory=dict)
    # prefill request index -> (m, slot): the state after its first m tokens goes to slot
    # (ScheduledRequest.state_snapshot_at inside the chunk)
    snapshots: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def build(cls, fb: ForwardBatch, slots: list[int] | None, verify: list[bool] | None
              ) -> "RecurrentMeta":
        """`slots` None: stateless (every request from zeros, nothing written)."""
        n = fb.num_reqs
        offsets, off = [], 0
        for q in fb.q_lens:
            offsets.append(off)
            off += q
        stateful = slots is not None
        meta = cls(slots=list(slots) if stateful else [0] * n, offsets=offsets,
                   q_lens=list(fb.q_lens),
                   has_state=[stateful and s > 0 for s in fb.start_pos],
                   verify=list(verify) if verify is not None else [False] * n)
        if stateful:  # (a one-token prompt at position 0 runs as a prefill: from zeros)
            meta.decode = [i for i in range(n) if fb.q_lens[i] == 1 and not meta.verify[i]
                           and meta.has_state[i]]
        if meta.decode:
            device = fb.input_ids.device
            meta.decode_tokens = torch.tensor([offsets[i] for i in meta.decode], device=device)
            meta.decode_slots = torch.tensor([meta.slots[i] for i in meta.decode],
                                             device=device)
        return meta

    def sequences(self):
        """(request index, first token, token count, kind) of the rows not decoded in one
        batched step: "prefill" or "verify"."""
        batched = set(self.decode)
        for i, (lo, n) in enumerate(zip(self.offsets, self.q_lens)):
            if i not in batched:
                yield i, lo, n, "verify" if self.verify[i] else "prefill"


class RecurrentBackend:
    def __init__(self, pool: RecurrentStatePool | None):
        self.pool = pool

    # ------------------------------------------------------------------ per layer
    def conv(self, layer: int, fb: ForwardBatch, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        """silu(causal conv1d) of x [T, Cd] over each request's window; windows advance."""
        meta = self._meta(fb)
        out = torch.empty_like(x)
        windows = self.pool.conv[layer] if meta.decode or self._stateful(meta) else None
        if meta.decode:
            y, new = conv_step(x.index_select(0, meta.decode_tokens), weight, bias,
                               windows.index_select(0, meta.decode_slots))
            out.index_copy_(0, meta.decode_tokens, y)
            windows.index_copy_(0, meta.decode_slots, new)
        for i, lo, n, kind in meta.sequences():
            slot = meta.slots[i]
            window = windows[slot] if meta.has_state[i] else None
            out[lo:lo + n], full = conv_chunk(x[lo:lo + n], weight, bias, window)
            if kind == "verify":
                meta.pending.setdefault(i, {})[layer] = (full, None)
            elif slot:
                windows[slot] = full[:, full.shape[1] - windows.shape[-1]:]
                if i in meta.snapshots:  # the window after the first m tokens
                    m, snap = meta.snapshots[i]
                    windows[snap] = full[:, m:m + windows.shape[-1]]
        return out

    def gated_delta(self, layer: int, fb: ForwardBatch, q, k, v, g, beta) -> torch.Tensor:
        """Gated DeltaNet over q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv]: o [T, Hv, Dv]
        float32; each request's state read from and left in its slot."""
        return self._scan(layer, fb, (q, k, v, g, beta), gated_delta_step, chunk_gated_delta,
                          gated_delta_steps, v.shape, fused_step.gated_delta_step)

    def ssd(self, layer: int, fb: ForwardBatch, x, dt, A, B, C, D) -> torch.Tensor:
        """Mamba2's scan over x [T, H, P], dt [T, H] (discretized), B, C [T, G, N]: y
        [T, H, P] float32 (D skip included)."""
        def with_params(fn: Callable) -> Callable:
            return lambda x_, dt_, B_, C_, s: fn(x_, dt_, A, B_, C_, D, s)

        def fused(states, slots, x_, dt_, B_, C_):
            return fused_step.ssd_step(states, slots, x_, dt_, A, B_, C_, D)

        return self._scan(layer, fb, (x, dt, B, C), with_params(ssd_step),
                          with_params(ssd_chunk_scan), with_params(ssd_steps), x.shape, fused)

    def _scan(self, layer: int, fb: ForwardBatch, inputs: tuple, step: Callable,
              chunked: Callable, steps: Callable, out_shape, fused: Callable
              ) -> torch.Tensor:
        """`fused(states, slots, *inputs)`: the decode rows' step in place on the pool (C,
        fused_step.py), or None where it does not apply (then `step` over gathered slots)."""
        meta = self._meta(fb)
        out = torch.empty(out_shape, dtype=torch.float32, device=inputs[0].device)
        states = self.pool.ssm[layer] if meta.decode or self._stateful(meta) else None
        if meta.decode:
            rows = [t.index_select(0, meta.decode_tokens) for t in inputs]
            y = fused(states, meta.decode_slots, *rows)
            if y is None:
                y, new = step(*rows, states.index_select(0, meta.decode_slots))
                states.index_copy_(0, meta.decode_slots, new.to(states.dtype))
            out.index_copy_(0, meta.decode_tokens, y)
        for i, lo, n, kind in meta.sequences():
            slot = meta.slots[i]
            init = states[slot][None] if meta.has_state[i] else None
            seq = tuple(t[lo:lo + n][None] for t in inputs)
            if kind == "verify":
                y, every = steps(*seq, init)
                full, _ = meta.pending[i][layer]
                meta.pending[i][layer] = (full, every[0])
            elif i in meta.snapshots:  # split at the interior snapshot
                m, snap = meta.snapshots[i]
                y_head, mid = chunked(*(t[:, :m] for t in seq), init)
                states[snap] = mid[0].to(states.dtype)
                y_tail, final = chunked(*(t[:, m:] for t in seq), mid)
                states[slot] = final[0].to(states.dtype)
                y = torch.cat([y_head, y_tail], dim=1)
            else:
                y, final = chunked(*seq, init)
                if slot:
                    states[slot] = final[0].to(states.dtype)
            out[lo:lo + n] = y[0]
        return out

    # ------------------------------------------------------------------ after the forward
    def commit(self, meta: RecurrentMeta, i: int, step: int) -> None:
        """Verify entry i accepted its tokens 0..step: their state goes into its slot."""
        slot = meta.slots[i]
        width = self.pool.conv.shape[-1] if self.pool.conv is not None else 0
        for layer, (full, every) in meta.pending.pop(i).items():
            if width:
                self.pool.conv[layer, slot] = full[:, step + 1:step + 1 + width]
            self.pool.ssm[layer, slot] = every[step].to(self.pool.ssm.dtype)

    @staticmethod
    def _meta(fb: ForwardBatch) -> RecurrentMeta:
        if fb.recurrent is None:  # no state pool behind this forward: from zeros, kept nowhere
            fb.recurrent = RecurrentMeta.build(fb, None, None)
        return fb.recurrent

    @staticmethod
    def _stateful(meta: RecurrentMeta) -> bool:
        return any(meta.slots)
