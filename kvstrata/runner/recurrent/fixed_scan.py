"""Deterministic inference's recurrent backend (--enable-deterministic-inference on Qwen3.5 /
Qwen3-Next Gated DeltaNet and Nemotron-H / Mamba2 layers): a request's conv window and SSM
state are a function of its tokens only.

Why: the chunked scans (ssd.py, gated_delta.py) sum in chunks that start where a prompt's
chunk starts, and the decode step (csrc/recurrent_step.c) advances the state token by token,
so a state snapshot taken mid-way and continued (a prefix hit), a prompt chunked otherwise or
recomputed after a retraction gave other bits than a straight run. Here every token, prompt
or decode, advances its request's state through that same C step in place on its state slot,
one token at a time and in order (the state rounded to the pool's dtype after every token, as
decode does): the state after n tokens is the same whether they came in one prefill, in
chunks or as decode steps, and a snapshot is a copy of it. A (row, head) pair's arithmetic in
the C step does not depend on how many rows share the call (one body per ISA level, each pair
on one thread), so decode rows stay one batched call.

The causal conv sums its K taps per output in one order (float32 products and sums, each an
exactly rounded element-wise op whatever the layout: the same bits for a prompt's columns
and a decode row), then SiLU position-free (pointwise.py). q and k are normalised per row
(gated_delta.prepare_qk over contiguous rows).
A prompt's scan is one C call per token and layer instead of one chunk matmul per 64 tokens:
at Qwen3.5-like head widths no slower (384 tokens of 8 heads of 64 x 64: 4.0-4.7 ms against
the chunked rule's 9.8-10.3 ms, docs/benchmarks.md). Speculative verify entries are refused
(rules/deterministic.py).
"""
from __future__ import annotations

from typing import Callable

import torch

from kvstrata.runner.cpu.isa import isa_cap
from kvstrata.runner.recurrent import _recurrent_step, pointwise
from kvstrata.runner.recurrent.backend import RecurrentBackend
from kvstrata.runner.recurrent.gated_delta import prepare_qk

STATE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
KERNEL = ("the recurrent layers' one-token C step for every token, prompt or decode, in "
          "place on the state slot (runner/recurrent/fixed_scan.py); the causal conv's taps "
          "in one order; SiLU / sigmoid / softplus position-free (runner/recurrent/"
          "pointwise.py)")


def conv_taps(full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
    """silu(causal conv) float32 [..., Cd, L] of full [..., Cd, K - 1 + L] (the window, then
    L new inputs): each output sums tap 0 .. K - 1 in that order, then the bias."""
    kernel = weight.shape[-1]
    length = full.shape[-1] - kernel + 1
    w = weight.float()
    acc = full[..., 0:length].float() * w[:, 0:1]
    for tap in range(1, kernel):
        acc = acc + full[..., tap:tap + length].float() * w[:, tap:tap + 1]
    if bias is not None:
        acc = acc + bias.float()[:, None]
    return pointwise.silu(acc)


class FixedRecurrentBackend(RecurrentBackend):
    """RecurrentBackend's interface (conv, gated_delta, ssd) computed as the module docstring
    says."""

    def conv(self, layer: int, fb, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        meta = self._meta(fb)
        self._refuse_verify(meta)
        out = torch.empty_like(x)
        windows = self.pool.conv[layer] if self._stateful(meta) else None
        if meta.decode:
            rows = meta.decode_tokens
            full = torch.cat([windows.index_select(0, meta.decode_slots).to(x.dtype),
                              x.index_select(0, rows)[:, :, None]], dim=2)
            out.index_copy_(0, rows, conv_taps(full, weight, bias)[:, :, 0].to(x.dtype))
            windows.index_copy_(0, meta.decode_slots, full[:, :, 1:].to(windows.dtype))
        width = weight.shape[-1] - 1
        for i, lo, n, _ in meta.sequences():
            slot = meta.slots[i]
            window = (windows[slot].to(x.dtype) if meta.has_state[i]
                      else x.new_zeros(x.shape[1], width))
            full = torch.cat([window, x[lo:lo + n].t()], dim=1)
            out[lo:lo + n] = conv_taps(full, weight, bias).t().to(x.dtype)
            if slot:
                windows[slot] = full[:, full.shape[1] - width:]
                if i in meta.snapshots:  # the window after the first m tokens
                    m, snap = meta.snapshots[i]
                    windows[snap] = full[:, m:m + width]
        return out

    def gated_delta(self, layer: int, fb, q, k, v, g, beta) -> torch.Tensor:
        hv, dv = v.shape[1], v.shape[2]
        q, k = prepare_qk(q.contiguous(), k.contiguous(), hv)
        dk = q.shape[-1]
        threads, cap = torch.get_num_threads(), isa_cap()  # once: launched per token

        def launch(states, slots, n, q_, k_, v_, g_, beta_, out):
            _recurrent_step.gated_delta_step(
                states.data_ptr(), slots.data_ptr(), n, q_, k_, v_, g_, beta_, out, hv, dk, dv,
                STATE_DTYPES[states.dtype], threads, cap)

        return self._fixed_scan(layer, fb, (q, k, v, g, beta), (hv, dv), (hv, dk, dv), launch)

    def ssd(self, layer: int, fb, x, dt, A, B, C, D) -> torch.Tensor:
        heads, p = x.shape[1], x.shape[2]
        groups, n_state = B.shape[1], B.shape[2]
        A, D = A.float().contiguous(), D.float().contiguous()
        threads, cap = torch.get_num_threads(), isa_cap()  # once: launched per token

        def launch(states, slots, n, x_, dt_, b_, c_, out):
            _recurrent_step.ssd_step(
                states.data_ptr(), slots.data_ptr(), n, x_, dt_, A.data_ptr(), b_, c_,
                D.data_ptr(), out, heads, p, n_state, groups, STATE_DTYPES[states.dtype],
                threads, cap)

        return self._fixed_scan(layer, fb, (x, dt, B, C), (heads, p), (heads, p, n_state),
                                launch)

    def _fixed_scan(self, layer: int, fb, inputs: tuple, out_dims: tuple, state_shape: tuple,
                    launch: Callable) -> torch.Tensor:
        """`launch(states, slots, n, *row addresses, out address)`: the C step over n rows
        of the inputs (float32, contiguous) from the given addresses, row r on state slot
        slots[r], its output written from the out address."""
        meta = self._meta(fb)
        self._refuse_verify(meta)
        inputs = tuple(t.float().contiguous() for t in inputs)
        out = torch.empty(inputs[0].shape[0], *out_dims, dtype=torch.float32)
        states = self.pool.ssm[layer] if self._stateful(meta) else None
        if states is not None and (states.dtype not in STATE_DTYPES
                                   or not states.is_contiguous()):
            raise ValueError(f"--enable-deterministic-inference: a {states.dtype} state pool "
                             f"(the recurrent C step keeps float32 or bfloat16 states)")
        if meta.decode:
            rows = [t.index_select(0, meta.decode_tokens) for t in inputs]
            y = torch.empty(len(meta.decode), *out_dims, dtype=torch.float32)
            launch(states, meta.decode_slots.contiguous(), len(meta.decode),
                   *(t.data_ptr() for t in rows), y.data_ptr())
            out.index_copy_(0, meta.decode_tokens, y)
        # per tensor (address of row 0, bytes per row): a token's rows by address arithmetic
        layout = [(t.data_ptr(), t.stride(0) * t.element_size()) for t in (*inputs, out)]
        for i, lo, n, _ in meta.sequences():
            slot = meta.slots[i]
            if slot:
                work, slots = states, torch.tensor([slot], dtype=torch.int64)
                if not meta.has_state[i]:  # a prompt from position 0: from zeros
                    work[slot].zero_()
            else:  # no state pool behind this forward: a scratch slot from zeros
                work = torch.zeros(1, *state_shape, dtype=torch.float32)
                slots = torch.zeros(1, dtype=torch.int64)
            snapshot = meta.snapshots.get(i)
            for t in range(lo, lo + n):  # one token at a time, in order
                launch(work, slots, 1, *(base + t * row for base, row in layout))
                if snapshot is not None and t + 1 - lo == snapshot[0]:
                    work[snapshot[1]] = work[slot]
        return out

    def commit(self, meta, i: int, step: int) -> None:
        raise NotImplementedError("--enable-deterministic-inference: speculative verify "
                                  "entries on recurrent layers are not built")

    @staticmethod
    def _refuse_verify(meta) -> None:
        if any(meta.verify):
            raise NotImplementedError("--enable-deterministic-inference: speculative verify "
                                      "entries on recurrent layers are not built")
