"""Paged attention in plain torch (CPU and CUDA alike): scaled_dot_product_attention over K/V
gathered through req_to_token.

Once per step (not per layer) `init_forward_metadata` turns the batch into a short plan of
attention pieces; each layer then writes its new K/V at their slots and runs the plan:

  fresh  a request whose keys are exactly its new tokens (prompt from position 0): SDPA with
         is_causal straight on the fresh K/V rows -- no gather, no mask, and the CPU flash
         kernel skips the blocks above the diagonal. Where paged_decode.prefill_supported
         says so (its vector code runs: AVX-512 or AVX2 + FMA), fresh and causal paged
         pieces of 8+ tokens (bf16 with AMX: up to paged_decode.prefill_max_tokens, longer
         ones on SDPA) instead go through kvstrata's prefill kernel, all of a step's in
         one call a layer, keys read from the pool through their slots (1.8-2.9x torch's flash
         attention at SmolLM2's shape on AVX-512, 1.0-2.4x on AVX2; meta.prefill).
  paged  a multi-token request with cached context (prefix hit, later prefill chunk): gather
         its K/V, explicit causal mask offset by its start.
  decode a group of one-token requests of similar context length: gather K/V padded to the
         group's longest context, one SDPA call with a length mask.
  kernel every one-token request at once, read in place from an fp32, bf16 or fp16 pool on
         the CPU by the paged decode kernel (paged_decode.py): no gather, no padding. Replaces `decode`
         pieces where it applies (KVSTRATA_CPU_PAGED_DECODE=0 turns it off).

Why pieces rather than one padded SDPA over the whole batch: on CPU decode is memory-bound on
the K/V gather (every layer copies each request's whole context) and on SDPA reading it back,
and one padded call pays for B * max_len rows. Sorting decode requests by length and cutting
them into a few groups removes most of the padding for a few extra ops per layer (see
piece_planner.py's `_split`); prefill loses its padded [B, Q] query layout and the O(Q * S) mask.

Gathers use one index_select per K and per V over the layer's contiguous [slots, H * D] rows
(measured ~10x faster on CPU than advanced indexing of the (2, slots, H, D) view).
GQA: prefill passes enable_gqa (query head h uses KV head h // (Hq / Hkv), as in HF); decode
folds the Hq / Hkv query heads of each KV head into that many query rows of one head, the
same arithmetic without SDPA's GQA path.

Deterministic inference (`deterministic`): one summation order per query row, whatever shares
its call. Full-attention layers without sinks / soft-capping over a bf16 pool on AVX512-BF16
(`fixed_order`, paged_decode.fixed_order_pays) run the prefill kernel's order: every prompt, chunk or verify entry of any length in the prefill kernel, decode
rows as a `fixed` kernel piece (one-row prompts of it, csrc/decode_fixed.h). Others (fp32,
windowed layers, sinks / soft-capping) run every query as a paged decode kernel query over
its own keys (the `ranged` list).

Sliding windows (`layer_windows`), attention sinks and logit soft-capping: window.py.
Hybrid SWA memory (`swa_pool`): the windowed layers keep their K/V in a second pool whose
slots a second req_to_token table (`swa_req_to_token`) records; `kv_of(layer)` names each
layer's pool and its index there, and the windowed layers' plans read key slots from the SWA
table and write new K/V at `fb.swa_out_slots`.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from kvstrata import envs
from kvstrata.kv.device_pool import MHATokenToKVPool
from kvstrata.kv.req_to_token import ReqToTokenTable
from kvstrata.runner.attention import paged_decode, window as win
from kvstrata.runner.attention.piece_planner import KERNEL_MAX_QUERY_TOKENS, PiecePlanner
from kvstrata.runner.attention.pieces import Piece, TorchNativeMeta
from kvstrata.runner.forward_batch import ForwardBatch


class TorchNativeAttnBackend(PiecePlanner):
    def __init__(self, kv_pool: MHATokenToKVPool | None, req_to_token: ReqToTokenTable | None,
                 num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 page_size: int = 1, deterministic: bool = False,
                 layer_windows: Sequence[int | None] | None = None,
                 swa_pool: MHATokenToKVPool | None = None,
                 swa_req_to_token: ReqToTokenTable | None = None,
                 softmax_extras: bool = False):
        """layer_windows[i] = W: layer i's query at position p sees keys p - W + 1 .. p
        (transformers' sliding_window); None (or no list): full causal. swa_pool /
        swa_req_to_token: hybrid SWA memory, the windowed layers' pool and slots (kv_pool
        then holds the full-attention layers only; None when there are none). softmax_extras:
        the model's layers pass sinks or a soft-cap (under deterministic inference they keep
        the decode kernel's order)."""
        self.kv_pool = kv_pool
        self.page_size = page_size
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.gqa = num_heads != num_kv_heads
        self.layer_windows = win.normalise_windows(layer_windows)
        self.swa_pool, self.swa_req_to_token = swa_pool, swa_req_to_token
        self.layer_kv = win.layer_pools(self.layer_windows, kv_pool, swa_pool)
        kv_pool = kv_pool if kv_pool is not None else swa_pool  # dtype and device below
        self.group = num_heads // num_kv_heads
        self.use_kernel = (kv_pool is not None and envs.KVSTRATA_CPU_PAGED_DECODE.get()
                           and paged_decode.supported(kv_pool.kv.dtype, torch.float32,
                                                      kv_pool.kv.device))
        # A prompt over its own tokens: our prefill kernel where it beats SDPA (its rule).
        dtype = kv_pool.kv.dtype if kv_pool is not None else None
        self.use_prefill_kernel = (dtype is not None
                                   and envs.KVSTRATA_CPU_PREFILL_ATTENTION.get()
                                   and paged_decode.prefill_supported(dtype, head_dim,
                                                                      kv_pool.kv.device))
        self.prefill_max_tokens = (paged_decode.prefill_max_tokens(dtype)
                                   if self.use_prefill_kernel else None)
        # Deterministic inference: every query token, prompt or decode, through the paged
        # decode kernel, whose result for a query depends on its own keys only -- so a prompt
        # token attends bit-identically whether its prefix was computed in this forward, read
        # from a cache hit, restored from L2 / L3 or sent by a prefill server, whatever the
        # chunking and the batch (SGLang fixes its split-KV size for the same end).
        self.deterministic = deterministic
        if deterministic:
            if kv_pool is not None and not paged_decode.supported(
                    kv_pool.kv.dtype, torch.float32, kv_pool.kv.device):
                raise ValueError("--enable-deterministic-inference needs the CPU paged "
                                 f"attention kernel (a {kv_pool.kv.dtype} pool on the CPU); "
                                 f"this pool is {kv_pool.kv.dtype} on {kv_pool.kv.device}")
            self.use_kernel, self.use_prefill_kernel = kv_pool is not None, False
        # ... or in one order that a tile of a prompt's rows computes as fast as the prefill
        # kernel, where that pays (paged_decode.fixed_order_pays: bf16 on AVX512-BF16):
        # full-attention layers without softmax extras run every query, prompt or decode, in
        # the prefill kernel's order (prompts in it, decode rows as one-row prompts of it:
        # paged_decode `fixed`). Windowed layers (their rows see key ranges that do not start
        # at position 0) and sinks / soft-capping keep the decode kernel's order.
        self.fixed_order = (deterministic and kv_pool is not None and not softmax_extras
                            and kv_pool.kv.dtype in paged_decode.Q_DTYPES
                            and head_dim <= paged_decode.PREFILL_MAX_HEAD_DIM
                            and paged_decode.fixed_order_pays(kv_pool.kv.dtype, head_dim)
                            and envs.KVSTRATA_CPU_DETERMINISTIC_BLOCKS.get()
                            and envs.KVSTRATA_CPU_PREFILL_ATTENTION.get())

    # ------------------------------------------------------------------ per step
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.out_slots is None and fb.num_reqs != 1:
            raise ValueError("a no-cache forward takes exactly one request")
        if self.layer_windows is None:
            fb.attn_meta = self._meta(fb, None)
        else:  # one plan per distinct window (window.py)
            fb.attn_meta = win.plan_windows(fb, self.layer_windows, self._meta,
                                            self.swa_pool is not None,
                                            share_full=not self.fixed_order)

    def kv_of(self, layer: int) -> tuple[MHATokenToKVPool, int]:
        """The pool holding `layer`'s K/V and the layer's index in it."""
        return self.layer_kv[layer]

    def _meta(self, fb: ForwardBatch, window: int | None, swa: bool = False
              ) -> TorchNativeMeta:
        """The step's plan for layers of this window (None: full causal); `swa`: for layers
        in the SWA pool (key slots from its table)."""
        device = fb.input_ids.device
        r2t = self.swa_req_to_token if swa else self.req_to_token
        table = r2t.table if r2t is not None else None
        pieces: list[Piece] = []
        decode: list[tuple] = []   # (kv_len, flat token, row[, explicit key slots])
        off = 0
        trees = fb.trees or {}
        fixed = self.fixed_order and window is None  # (the prefill kernel's order)
        if fb.query_keys is not None:  # explicit keys per token (a draft tree step)
            decode = [(len(k), j, 0, k) for j, k in enumerate(fb.query_keys)]
            if window is not None:
                decode = [win.clip(e, table, window) for e in decode]
            if self.use_kernel:
                return TorchNativeMeta([self._kernel_piece(decode, r2t, device, fixed)], False)
            return TorchNativeMeta([self._explicit_piece(decode, table, device)], False)
        ranged: list[tuple] = []   # deterministic: (row, start, n, flat token), not decodes
        for i, (row, start, n) in enumerate(zip(fb.rows, fb.start_pos, fb.q_lens)):
            if i in trees:  # a draft tree: each token sees the context and its ancestors
                pieces += self._tree(trees[i], table, row, start, off, decode, device,
                                     window)
            elif fixed and (n > 1 or start == 0) and fb.out_slots is not None:
                # a prompt (chunk, verify entry) of any length: the prefill kernel
                pieces.append(Piece("fresh" if start == 0 else "paged", off, off + n, row=row,
                                    prefix=start))
            elif self.deterministic and (n > 1 or start == 0) and fb.out_slots is not None:
                ranged.append((row, start, n, off))  # (a one-token prompt too: not SDPA)
            elif window is not None and start + n > window and (
                    start == 0 or fb.out_slots is None or n > 1 and not (
                        self.use_kernel and n <= KERNEL_MAX_QUERY_TOKENS)):
                # Some query sees fewer keys than its causal prefix: banded pieces.
                if start == 0 or fb.out_slots is None:
                    pieces += win.fresh_pieces(off, n, window, device)
                else:
                    pieces += win.paged_pieces(self, table, row, start, n, off, window,
                                               device)
            elif start == 0 or fb.out_slots is None:
                pieces.append(Piece("fresh", off, off + n, row=row, prefix=0))
            elif n == 1:
                decode.append((start + 1, off, row))
            elif self.use_kernel and n <= KERNEL_MAX_QUERY_TOKENS:
                # A few tokens after a cached context (a speculative verify entry): token j
                # is a one-token query over keys 0 .. start + j, so the paged decode kernel
                # runs it in place like any decode query -- no gather, and the same
                # arithmetic as the plain decode step it must agree with.
                decode.extend((start + j + 1, off + j, row) for j in range(n))
            else:
                kv_len = start + n
                rows_t = torch.tensor([row], dtype=torch.int64).to(device)
                kv_idx, unit, s = self.kv_index(table, rows_t, kv_len, [kv_len])
                # Query i (position start + i) sees keys 0 .. start + i (this also hides the
                # page padding past kv_len).
                q_pos = torch.arange(start, kv_len, device=device)
                mask = torch.arange(s, device=device)[None, :] <= q_pos[:, None]
                pieces.append(Piece("paged", off, off + n, kv_idx, unit, mask, row=row,
                                    prefix=start))
            off += n
        if window is not None:  # one-token queries over their last `window` keys
            decode = [win.clip(e, table, window) for e in decode]
        if ranged:  # deterministic: one kernel call over every token of the forward
            pieces.append(self._ranges_piece(ranged, decode, table, window))
        elif decode and self.use_kernel:
            pieces.append(self._kernel_piece(decode, r2t, device, fixed))
        elif decode and any(len(e) > 3 for e in decode):  # (windowed: explicit keys)
            pieces.append(self._explicit_piece(decode, table, device))
        elif decode:
            pieces.extend(self._decode_pieces(decode, table, device))
        single = len(pieces) == 1 and pieces[0].tok_idx is None
        return TorchNativeMeta(pieces, single,
                               self._prefill_plan(pieces, table, fb.out_slots, fixed))

    # ------------------------------------------------------------------ per layer
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, sinks: torch.Tensor | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (already rotated) -> attention output [T, Hq * D].
        sinks: fp32 [Hq] logits that join each row's softmax denominator (gpt-oss);
        softcap: scores = softcap * tanh(scores / softcap) (Gemma 2). Either one runs the
        layer in explicit torch math (window.py), or with deterministic inference in the
        paged decode kernel, which has both."""
        meta: TorchNativeMeta = fb.attn_meta
        if meta.by_window is not None:
            meta = meta.by_window[self.layer_windows[layer]]
        if fb.out_slots is not None:
            pool, li = self.layer_kv[layer]
            pool.set_kv(li, fb.swa_out_slots if pool is self.swa_pool else fb.out_slots, k, v)
        if sinks is not None or softcap is not None:
            if self.fixed_order:  # its plan holds prefill-kernel pieces, which have neither
                raise ValueError("deterministic inference: a layer passed sinks / softcap to "
                                 "a backend built without softmax_extras")
            return win.forward_math(self, layer, meta, q, k, v, sinks, softcap)
        out, done = self._prefill_by_kernel(layer, meta, q)
        if meta.single:
            return out if done else self.run_piece(layer, meta.pieces[0], q, k, v)
        if out is None:
            out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        skip = {id(p) for p in done}
        for p in meta.pieces:
            if id(p) in skip:
                continue
            res = self.run_piece(layer, p, q, k, v)
            if p.tok_idx is None:
                out[p.lo:p.hi] = res
            else:
                out.index_copy_(0, p.tok_idx, res)
        return out

    def _prefill_by_kernel(self, layer: int, meta: "TorchNativeMeta", q: torch.Tensor
                           ) -> tuple[torch.Tensor | None, list]:
        """The step's prompts in meta.prefill through the prefill kernel, one call: (the
        layer's output buffer with their rows written, their pieces), or (None, []) when
        there are none or the tensors do not fit (they take SDPA in _piece)."""
        if meta.prefill is None:
            return None, []
        chosen, slots, seqs = meta.prefill
        pool, li = self.layer_kv[layer]
        qk = q
        if self.fixed_order and q.dtype != pool.kv.dtype:  # the order needs one dtype
            qk = q.to(pool.kv.dtype)
        out = qk.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if paged_decode.prefill_attention(qk, pool.k(li), pool.v(li),
                                          slots, seqs, self.scale,
                                          out=out.view(q.shape)) is None:
            if self.fixed_order:  # no SDPA here: it would sum in another order
                raise RuntimeError(f"deterministic inference: the prefill kernel refused q "
                                   f"{q.dtype} {tuple(q.shape)} strides {q.stride()}")
            return None, []
        return out.to(q.dtype), chosen

    def gather_kv(self, layer: int, kv_idx: torch.Tensor, unit: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of rows `kv_idx` (each `unit` slots) as [N * unit, Hkv, D] each (the
        windowed math path, window.py, reads its keys through it too)."""
        hkv, d = self.num_kv_heads, self.head_dim
        pool, li = self.layer_kv[layer]
        keys = pool.k(li).view(-1, unit * hkv * d).index_select(0, kv_idx)
        values = pool.v(li).view(-1, unit * hkv * d).index_select(0, kv_idx)
        if keys.dtype != dtype:
            keys, values = keys.to(dtype), values.to(dtype)
        return keys.view(-1, hkv, d), values.view(-1, hkv, d)

    def run_piece(self, layer: int, p: Piece, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
        """One piece's output [its tokens, Hq * D]; sinks (fp32 [Hq]) / softcap (0: none):
        a kernel piece's softmax extras (window.forward_math, deterministic inference)."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if p.kind == "kernel":
            qg = q[p.lo:p.hi] if p.tok_idx is None else q.index_select(0, p.tok_idx)
            pool, li = self.layer_kv[layer]
            if p.fixed and qg.dtype != pool.kv.dtype:  # the prefill kernel's order: one dtype
                qg = qg.to(pool.kv.dtype)
            if qg.dtype not in paged_decode.Q_DTYPES or paged_decode.row_stride(qg) is None:
                qg = qg.to(torch.float32).contiguous()  # fp16: the kernel reads fp32 or bf16
            if p.decode_call is None:  # the checks once a forward, not once a layer
                p.decode_call = paged_decode.DecodeCall(p.slots, p.starts, self.scale,
                                                        p.ends, p.fixed)
            out = p.decode_call(qg, pool.k(li), pool.v(li), sinks, softcap)
            return out.to(q.dtype).reshape(p.n, hq * d)
        if p.kind == "decode":
            n = p.n
            keys, values = self.gather_kv(layer, p.kv_idx, p.unit, q.dtype)
            keys = keys.view(n, -1, hkv, d).transpose(1, 2)         # [n, Hkv, S, D]
            values = values.view(n, -1, hkv, d).transpose(1, 2)
            qg = q[p.lo:p.hi] if p.tok_idx is None else q.index_select(0, p.tok_idx)
            # GQA fold: the `group` query heads of KV head h are `group` query rows of h.
            qg = qg.reshape(n, hkv, self.group, d)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=p.mask,
                                                 scale=self.scale)   # [n, Hkv, group, D]
            return out.reshape(n, hq * d)
        qr = q[p.lo:p.hi].transpose(0, 1)                             # [Hq, n, D]
        if p.kind == "fresh":
            klo = p.lo if p.key_lo < 0 else p.key_lo  # a windowed block starts earlier
            keys, values = k[klo:p.hi], v[klo:p.hi]
        else:
            keys, values = self.gather_kv(layer, p.kv_idx, p.unit, q.dtype)
        mask = p.mask
        if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
            mask = p.mask = mask.to(q.dtype)  # a windowed band (additive): once a forward
        # 4-D inputs (a batch of one): with 3-D ones torch's CPU SDPA takes its math path
        # (bmm, softmax over the whole [H, n, S] score matrix), measured 6x slower than the
        # flash kernel on a 2048-token prompt.
        out = F.scaled_dot_product_attention(
            qr[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=p.kind == "fresh" and mask is None, scale=self.scale,
            enable_gqa=self.gqa)[0]                                   # [Hq, n, D]
        return out.transpose(0, 1).reshape(p.hi - p.lo, hq * d)
