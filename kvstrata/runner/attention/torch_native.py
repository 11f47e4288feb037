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
`_split`); prefill loses its padded [B, Q] query layout and the O(Q * S) mask.

Gathers use one index_select per K and per V over the layer's contiguous [slots, H * D] rows
(measured ~10x faster on CPU than advanced indexing of the (2, slots, H, D) view).
GQA: prefill passes enable_gqa (query head h uses KV head h // (Hq / Hkv), as in HF); decode
folds the Hq / Hkv query heads of each KV head into that many query rows of one head, the
same arithmetic without SDPA's GQA path.

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
from kvstrata.runner.attention.pieces import Piece, TorchNativeMeta
from kvstrata.runner.forward_batch import ForwardBatch, tree_ancestors

# Fixed cost of one more decode group, in gathered K/V rows (index_select x2, SDPA, q and out
# copies: ~4 ops of ~15-50 us each vs ~0.3-0.5 us per padded row of a 128-384 float K+V row on
# the 2-core dev box). A split must save more padded rows than this.
DECODE_GROUP_COST_ROWS = 256
MAX_DECODE_GROUPS = 8
# Multi-token pieces up to this many tokens (speculative verify entries) run as that many
# one-token queries through the paged decode kernel instead of a gathered, masked SDPA.
KERNEL_MAX_QUERY_TOKENS = 16


def _split(lens: list[int], lo: int, hi: int, depth: int, out: list[tuple[int, int]]) -> None:
    """Cut sorted lens[lo:hi] into groups: split where it saves the most padded rows (k rows
    that no longer pad up to the group maximum), recursively, while that beats the cost of
    a group. Greedy bisection: O(n log groups), cheap enough to run every step."""
    top = lens[hi - 1]
    best, best_k = 0, 0
    for k in range(lo + 1, hi):
        saving = (k - lo) * (top - lens[k - 1])
        if saving > best:
            best, best_k = saving, k
    if depth == 0 or best <= DECODE_GROUP_COST_ROWS:
        out.append((lo, hi))
        return
    _split(lens, lo, best_k, depth - 1, out)
    _split(lens, best_k, hi, depth - 1, out)


class TorchNativeAttnBackend:
    def __init__(self, kv_pool: MHATokenToKVPool | None, req_to_token: ReqToTokenTable | None,
                 num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 page_size: int = 1, deterministic: bool = False,
                 layer_windows: Sequence[int | None] | None = None,
                 swa_pool: MHATokenToKVPool | None = None,
                 swa_req_to_token: ReqToTokenTable | None = None):
        """layer_windows[i] = W: layer i's query at position p sees keys p - W + 1 .. p
        (transformers' sliding_window); None (or no list): full causal. swa_pool /
        swa_req_to_token: hybrid SWA memory, the windowed layers' pool and slots (kv_pool
        then holds the full-attention layers only; None when there are none)."""
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

    # ------------------------------------------------------------------ per step
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.out_slots is None and fb.num_reqs != 1:
            raise ValueError("a no-cache forward takes exactly one request")
        if self.layer_windows is None:
            fb.attn_meta = self._meta(fb, None)
        else:  # one plan per distinct window (window.py)
            fb.attn_meta = win.plan_windows(fb, self.layer_windows, self._meta,
                                            self.swa_pool is not None)

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
        if fb.query_keys is not None:  # explicit keys per token (a draft tree step)
            decode = [(len(k), j, 0, k) for j, k in enumerate(fb.query_keys)]
            if window is not None:
                decode = [win.clip(e, table, window) for e in decode]
            if self.use_kernel:
                return TorchNativeMeta([self._kernel_piece(decode, r2t, device)], False)
            return TorchNativeMeta([self._explicit_piece(decode, table, device)], False)
        ranged: list[tuple] = []   # deterministic: (row, start, n, flat token), not decodes
        for i, (row, start, n) in enumerate(zip(fb.rows, fb.start_pos, fb.q_lens)):
            if i in trees:  # a draft tree: each token sees the context and its ancestors
                pieces += self._tree(trees[i], table, row, start, off, decode, device,
                                     window)
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
                kv_idx, unit, s = self._kv_index(table, rows_t, kv_len, [kv_len])
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
            pieces.append(self._kernel_piece(decode, r2t, device))
        elif decode and any(len(e) > 3 for e in decode):  # (windowed: explicit keys)
            pieces.append(self._explicit_piece(decode, table, device))
        elif decode:
            pieces.extend(self._decode_pieces(decode, table, device))
        single = len(pieces) == 1 and pieces[0].tok_idx is None
        return TorchNativeMeta(pieces, single, self._prefill_plan(pieces, table, fb.out_slots))

    def _prefill_plan(self, pieces: list[Piece], table: torch.Tensor | None,
                      out_slots: torch.Tensor | None) -> tuple | None:
        """The prompts (fresh or after a cached prefix, 8+ tokens, causal) the prefill kernel
        serves this forward, with their key slots: it reads keys from the pool, so only in a
        forward that writes the pool."""
        if not self.use_prefill_kernel or out_slots is None or table is None:
            return None
        top = self.prefill_max_tokens
        chosen = [p for p in pieces if p.prefix >= 0
                  and p.hi - p.lo >= paged_decode.PREFILL_MIN_TOKENS
                  and (top is None or p.prefix + p.hi - p.lo <= top)]
        if not chosen:
            return None
        seqs, slots, off = [], [], 0
        for p in chosen:
            length = p.prefix + p.hi - p.lo
            slots.append(table[p.row, :length])
            seqs.append((p.lo, p.hi, off, p.prefix))
            off += length
        return chosen, torch.cat(slots), paged_decode.prefill_seqs(seqs)

    def _tree(self, parents: list[int], table: torch.Tensor, row: int, start: int, off: int,
              decode: list[tuple], device: torch.device, window: int | None = None
              ) -> list[Piece]:
        """A verify entry holding a draft tree (entry token j at slot row[start + j]): its
        tokens become one-token kernel queries over explicit key slots, or one paged piece
        whose mask shows each token the context and its ancestors (with a window: those of
        the last `window` positions; token j sits at position start + depth)."""
        anc = tree_ancestors(parents)
        n = len(parents)
        if self.use_kernel and (n <= KERNEL_MAX_QUERY_TOKENS or self.deterministic):
            entry = table[row, :start + n]
            for j, a in enumerate(anc):
                keys = torch.cat([entry[:start], entry[start + torch.tensor(a)]])
                decode.append((start + len(a), off + j, row, keys))  # (clipped by _meta)
            return []
        kv_len = start + n
        rows_t = torch.tensor([row], dtype=torch.int64).to(device)
        kv_idx, unit, s = self._kv_index(table, rows_t, kv_len, [kv_len])
        mask = torch.zeros(n, s, dtype=torch.bool)
        for j, a in enumerate(anc):
            if window is not None:  # position start + len(a) - 1 sees the last W positions
                mask[j, max(0, start + len(a) - window):start] = True
                a = a[-window:]
            else:
                mask[j, :start] = True
            mask[j, start + torch.tensor(a)] = True
        return [Piece("paged", off, off + n, kv_idx, unit, mask.to(device))]

    def _explicit_piece(self, decode: list[tuple], table: torch.Tensor | None,
                        device: torch.device) -> Piece:
        """One-token queries over explicit key slots (or their row's first kv_len), padded
        to the longest in one SDPA call (the path without the paged decode kernel)."""
        longest = max(e[0] for e in decode)
        idx = torch.zeros(len(decode), longest, dtype=torch.int64)
        for b, e in enumerate(decode):
            idx[b, :e[0]] = e[3] if len(e) > 3 else table[e[2], :e[0]]
        lens = torch.tensor([e[0] for e in decode], dtype=torch.int64)
        mask = (torch.arange(longest)[None, :] < lens[:, None])[:, None, None]
        toks = [e[1] for e in decode]
        contiguous = toks == list(range(toks[0], toks[0] + len(toks)))
        return Piece("decode", toks[0], toks[0] + len(toks), idx.reshape(-1).to(device),
                     mask=mask.to(device), n=len(decode),
                     tok_idx=None if contiguous else torch.tensor(toks).to(device))

    def _kernel_piece(self, decode: list[tuple], r2t: ReqToTokenTable,
                      device: torch.device) -> Piece:
        """All one-token requests in one kernel call: their slots 0 .. len - 1, concatenated
        (req_to_token.slots_of: one C pass), and where each starts. Tree tokens bring their
        own key slots (context + ancestors)."""
        rows, toks, lens = zip(*((e[2], e[1], e[0]) for e in decode))
        lens_t = torch.tensor(lens, dtype=torch.int64)
        if any(len(e) > 3 for e in decode):
            slots = torch.cat([e[3] if len(e) > 3 else r2t.table[e[2], :e[0]]
                               for e in decode])
        else:
            slots = r2t.slots_of(rows, lens)
        starts = torch.zeros(len(lens) + 1, dtype=torch.int64)
        torch.cumsum(lens_t, 0, out=starts[1:])
        contiguous = list(toks) == list(range(toks[0], toks[0] + len(toks)))
        return Piece("kernel", toks[0], toks[0] + len(toks), n=len(toks),
                     tok_idx=None if contiguous else torch.tensor(toks, dtype=torch.int64),
                     slots=slots.to(torch.int64).contiguous(), starts=starts)

    def _ranges_piece(self, ranged: list[tuple], decode: list[tuple],
                      table: torch.Tensor, window: int | None = None) -> Piece:
        """Deterministic inference: every token of the forward as a one-token query of the
        paged decode kernel. A request's tokens share one slot list (its keys 0 .. start + n
        - 1); token j's range ends at its own position start + j (and with a window begins
        `window` slots before that end), so a prompt costs its length in slots, not its
        length squared."""
        slots: list[torch.Tensor] = []
        tok_lo, begin, end = [], [], []
        off = 0
        for row, start, n, flat in ranged:
            slots.append(table[row, :start + n])
            tok_lo.extend(range(flat, flat + n))
            ends = range(off + start + 1, off + start + n + 1)
            begin.extend([off] * n if window is None else [max(off, e - window) for e in ends])
            end.extend(ends)
            off += start + n
        for entry in decode:  # one-token requests (explicit keys: a draft tree's token)
            keys = entry[3] if len(entry) > 3 else table[entry[2], :entry[0]]
            slots.append(keys)
            tok_lo.append(entry[1])
            begin.append(off)
            end.append(off + entry[0])
            off += entry[0]
        order = sorted(range(len(tok_lo)), key=tok_lo.__getitem__)
        toks = [tok_lo[i] for i in order]
        contiguous = toks == list(range(toks[0], toks[0] + len(toks)))
        return Piece("kernel", toks[0], toks[0] + len(toks), n=len(toks),
                     tok_idx=None if contiguous else torch.tensor(toks, dtype=torch.int64),
                     slots=torch.cat(slots).to(torch.int64).contiguous(),
                     starts=torch.tensor([begin[i] for i in order], dtype=torch.int64),
                     ends=torch.tensor([end[i] for i in order], dtype=torch.int64))

    def _decode_pieces(self, decode: list[tuple[int, int, int]], table: torch.Tensor,
                       device: torch.device) -> list[Piece]:
        decode.sort(key=lambda e: e[0])
        lens = [e[0] for e in decode]
        groups: list[tuple[int, int]] = []
        _split(lens, 0, len(lens), MAX_DECODE_GROUPS.bit_length() - 1, groups)
        pieces = []
        for lo, hi in groups:
            members = decode[lo:hi]
            s = members[-1][0]
            toks = [e[1] for e in members]
            g_lens = [e[0] for e in members]
            # Host lists go to the device in one copy: rows, flat tokens, lengths.
            packed = torch.tensor([[e[2] for e in members], toks, g_lens],
                                  dtype=torch.int64).to(device)
            kv_idx, unit, s_pad = self._kv_index(table, packed[0], s, g_lens, packed[2])
            mask = None
            if g_lens[0] != s_pad:
                # [n, 1, 1, S]: key j of request b is real iff j < len_b (hides padding).
                mask = (torch.arange(s_pad, device=device)[None, :] < packed[2][:, None])[:, None, None]
            contiguous = toks == list(range(toks[0], toks[0] + len(toks)))
            pieces.append(Piece("decode", toks[0], toks[0] + len(toks), kv_idx, mask=mask,
                                tok_idx=None if contiguous else packed[1], n=len(members),
                                unit=unit))
        return pieces

    def _kv_index(self, table: torch.Tensor, rows: torch.Tensor, s: int, lens: list[int],
                  lens_t: torch.Tensor | None = None, lo: int = 0
                  ) -> tuple[torch.Tensor, int, int]:
        """What to gather for keys lo .. s - 1 of `rows` (lo a multiple of the page size):
        (index, unit, padded length from lo).

        The scheduler places position p of a request at slot page * P + p % P (whole pages,
        kv_manager.slots), so a request's keys are whole pages of the pool: gathering
        [P * H * D]-float page rows instead of [H * D] token rows moves the same bytes in P
        times fewer, larger copies (~1.7x faster on the 2-core box). The layout is checked
        here, once per step, against the slots actually recorded (positions < len only: the
        rest is masked), falling back to token rows if anything does not match."""
        tok = table[rows, lo:s]                                          # [n, s - lo]
        P = self.page_size
        if P == 1:
            return tok.reshape(-1), 1, s - lo
        s_pad = -(-s // P) * P
        pages = table[rows, lo:s_pad:P] // P                             # [n, pages]
        derived = (pages[:, :, None] * P + torch.arange(P, device=rows.device)).reshape(
            rows.shape[0], s_pad - lo)[:, :s - lo]
        ok = derived == tok
        if min(lens) < s:
            if lens_t is None:
                lens_t = torch.tensor(lens, dtype=torch.int64).to(rows.device)
            ok |= torch.arange(lo, s, device=rows.device)[None, :] >= lens_t[:, None]
        if not bool(ok.all()):
            return tok.reshape(-1), 1, s - lo
        return pages.reshape(-1), P, s_pad - lo

    # ------------------------------------------------------------------ per layer
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, sinks: torch.Tensor | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (already rotated) -> attention output [T, Hq * D].
        sinks: fp32 [Hq] logits that join each row's softmax denominator (gpt-oss);
        softcap: scores = softcap * tanh(scores / softcap) (Gemma 2). Either one runs the
        layer in explicit torch math (window.py), never the C kernels."""
        meta: TorchNativeMeta = fb.attn_meta
        if meta.by_window is not None:
            meta = meta.by_window[self.layer_windows[layer]]
        if fb.out_slots is not None:
            pool, li = self.layer_kv[layer]
            pool.set_kv(li, fb.swa_out_slots if pool is self.swa_pool else fb.out_slots, k, v)
        if sinks is not None or softcap is not None:
            return win.forward_math(self, layer, meta, q, k, v, sinks, softcap)
        out, done = self._prefill_by_kernel(layer, meta, q)
        if meta.single:
            return out if done else self._piece(layer, meta.pieces[0], q, k, v)
        if out is None:
            out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        skip = {id(p) for p in done}
        for p in meta.pieces:
            if id(p) in skip:
                continue
            res = self._piece(layer, p, q, k, v)
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
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        pool, li = self.layer_kv[layer]
        if paged_decode.prefill_attention(q, pool.k(li), pool.v(li),
                                          slots, seqs, self.scale,
                                          out=out.view(q.shape)) is None:
            return None, []
        return out, chosen

    def _gather(self, layer: int, kv_idx: torch.Tensor, unit: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of rows `kv_idx` (each `unit` slots) as [N * unit, Hkv, D] each."""
        hkv, d = self.num_kv_heads, self.head_dim
        pool, li = self.layer_kv[layer]
        keys = pool.k(li).view(-1, unit * hkv * d).index_select(0, kv_idx)
        values = pool.v(li).view(-1, unit * hkv * d).index_select(0, kv_idx)
        if keys.dtype != dtype:
            keys, values = keys.to(dtype), values.to(dtype)
        return keys.view(-1, hkv, d), values.view(-1, hkv, d)

    def _piece(self, layer: int, p: Piece, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if p.kind == "kernel":
            qg = q[p.lo:p.hi] if p.tok_idx is None else q.index_select(0, p.tok_idx)
            if qg.dtype not in paged_decode.Q_DTYPES or paged_decode.row_stride(qg) is None:
                qg = qg.to(torch.float32).contiguous()  # fp16: the kernel reads fp32 or bf16
            if p.decode_call is None:  # the checks once a forward, not once a layer
                p.decode_call = paged_decode.DecodeCall(p.slots, p.starts, self.scale,
                                                        p.ends)
            pool, li = self.layer_kv[layer]
            out = p.decode_call(qg, pool.k(li), pool.v(li))
            return out.to(q.dtype).reshape(p.n, hq * d)
        if p.kind == "decode":
            n = p.n
            keys, values = self._gather(layer, p.kv_idx, p.unit, q.dtype)
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
            keys, values = self._gather(layer, p.kv_idx, p.unit, q.dtype)
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
