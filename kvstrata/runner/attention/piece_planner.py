"""TorchNativeAttnBackend's piece builders (torch_native.py's `_meta` picks which piece each
request of a step becomes; these build them): the prefill kernel's plan, draft trees, the
one-token query pieces (explicit keys, the paged decode kernel, deterministic ranges, length
groups for SDPA) and the gather index of a request's keys. A mixin: they read the backend's
shapes, page size, tables and kernel switches.
"""
from __future__ import annotations

import torch

from kvstrata.kv.req_to_token import ReqToTokenTable
from kvstrata.runner.attention import paged_decode
from kvstrata.runner.attention.pieces import Piece
from kvstrata.runner.forward_batch import tree_ancestors

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


class PiecePlanner:
    """Mixed into TorchNativeAttnBackend (its attributes: page_size, use_kernel,
    use_prefill_kernel, prefill_max_tokens, deterministic)."""

    page_size: int
    use_kernel: bool
    use_prefill_kernel: bool
    prefill_max_tokens: int | None
    deterministic: bool

    def _prefill_plan(self, pieces: list[Piece], table: torch.Tensor | None,
                      out_slots: torch.Tensor | None, fixed: bool = False) -> tuple | None:
        """The prompts (fresh or after a cached prefix, 8+ tokens, causal) the prefill kernel
        serves this forward, with their key slots: it reads keys from the pool, so only in a
        forward that writes the pool. `fixed` (deterministic inference): every prompt piece,
        whatever its length (a row's order must not depend on it)."""
        if not (self.use_prefill_kernel or fixed) or out_slots is None or table is None:
            return None
        top = None if fixed else self.prefill_max_tokens
        least = 1 if fixed else paged_decode.PREFILL_MIN_TOKENS
        chosen = [p for p in pieces if p.prefix >= 0 and p.kind in ("fresh", "paged")
                  and p.hi - p.lo >= least
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
        kv_idx, unit, s = self.kv_index(table, rows_t, kv_len, [kv_len])
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
                      device: torch.device, fixed: bool = False) -> Piece:
        """All one-token requests in one kernel call: their slots 0 .. len - 1, concatenated
        (req_to_token.slots_of: one C pass), and where each starts. Tree tokens bring their
        own key slots (context + ancestors). fixed: in the prefill kernel's order
        (deterministic inference)."""
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
                     slots=slots.to(torch.int64).contiguous(), starts=starts, fixed=fixed)

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
            kv_idx, unit, s_pad = self.kv_index(table, packed[0], s, g_lens, packed[2])
            mask = None
            if g_lens[0] != s_pad:
                # [n, 1, 1, S]: key j of request b is real iff j < len_b (hides padding).
                mask = (torch.arange(s_pad, device=device)[None, :] < packed[2][:, None])[:, None, None]
            contiguous = toks == list(range(toks[0], toks[0] + len(toks)))
            pieces.append(Piece("decode", toks[0], toks[0] + len(toks), kv_idx, mask=mask,
                                tok_idx=None if contiguous else packed[1], n=len(members),
                                unit=unit))
        return pieces

    def kv_index(self, table: torch.Tensor, rows: torch.Tensor, s: int, lens: list[int],
                  lens_t: torch.Tensor | None = None, lo: int = 0
                  ) -> tuple[torch.Tensor, int, int]:
        """What to gather for keys lo .. s - 1 of `rows` (lo a multiple of the page size):
        (index, unit, padded length from lo). The window pieces (window.py) plan with it too.

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
