"""Hybrid SWA memory across PD disaggregation, the page side (no torch).

SGLang (disaggregation/prefill.py send_kv_chunk, allocator alloc_extend_swa_tail): the prefill
sends the full-attention layers' pages of the whole prompt, but the sliding-window layers' pages
only for the prompt's last window, because no later query reads SWA KV further back; the decode
allocates full pages for the whole prompt and SWA pages only for that tail (earlier full pages
map to SWA page 0, "none").

The tail here starts at the page of position `seq_len - window + 1`, the first position the
decode's first query (at `seq_len`, the first output token) reads (q - W + 1 .. q,
runner/attention/window.py). SGLang starts one token earlier (`seq_len - window`); that token is
never read, and on the prefill side its page may lie just outside the request's SWA lock on its
tree prefix (cache/swa_pages.py `lock`: the last ceil((W - 1) / P) whole pages), where SWA
eviction could reuse it while the transfer reads it. Both sides call `tail_start_page` with the
same numbers, so they agree on how many SWA pages cross.

On the wire SWA pages are addressed in one page-id space with the full pages (the transfer
backends register the SWA pool's buffers as a second region, transfer/disagg/regions.py):
`wire_id = swa_base + swa_page`, where `swa_base` is the full pool's buffer page count (its page
ids 0..num_pages). So the rooms, the page counts and the ops stay one list of page ids.

With the decode radix cache (a decode-side hit of K whole pages, matched by the SWA radix cache:
its last window before K is live and SWA-locked) the delta moves: full pages [K, N) and the
last window's SWA pages from max(tail start, K). Those of the window inside the prefix are the
tree's (`held_tail_pages`): the decode names them `prefix_swa_pages` beside `prefix_pages`, and
the prefill's backend skips the first that many of its SWA pages as it skips the first K full
ones (the prefill's scheduler sends the same list either way).
"""
from __future__ import annotations

from typing import Any


def tail_start_page(seq_len: int, window: int, page_size: int) -> int:
    """First page of a `seq_len`-token prompt whose SWA KV the decode reads."""
    return max(seq_len - window + 1, 0) // page_size


def swa_base(num_full_pages: int) -> int:
    """Wire id of SWA page 0: the full pool's buffers hold pages 0..num_full_pages."""
    return num_full_pages + 1


def prefill_tail_wire_ids(kv: Any, req: Any, seq_len: int) -> list[int]:
    """The wire ids of the SWA pages the prefill sends for a prompt of `seq_len` tokens (its
    last window). They are live: the request computed them last, and its own release and its
    SWA lock on the tree prefix keep every page from `tail_start_page` on (see above)."""
    swa = kv.swa
    P = kv.page_size
    first = tail_start_page(seq_len, swa.window, P)
    full = req.pages[first:-(-seq_len // P)]
    dead = [i for i, p in enumerate(full, first) if not swa.map[p]]
    assert not dead, f"{req.rid}: prompt pages #{dead} in its last window have no SWA page"
    base = swa_base(kv.plan.num_pages)
    return [base + swa.map[p] for p in full]


def grow_swa_tail(kv: Any, req: Any, seq_len: int) -> bool:
    """alloc_extend_swa_tail: make req.pages cover [0, seq_len) with full pages, and give SWA
    pages only to the new ones from `tail_start_page` on (earlier ones count as given up:
    `swa_evicted_pages`). All or nothing; False when either pool lacks room. The request holds
    no pages yet, or only a decode radix prefix (its `num_tree_pages` matched pages, SWA-locked
    over their last window, which is live: cache/swa_radix.py): the tail's pages inside that
    prefix keep the tree's SWA pages (`held_tail_pages`), the rest get new ones."""
    assert len(req.pages) == req.num_tree_pages, f"{req.rid}: tail grow over own pages"
    P, swa = kv.page_size, kv.swa
    held = req.num_tree_pages
    total = -(-seq_len // P)
    first = max(min(tail_start_page(seq_len, swa.window, P), total), held)
    need, tail = total - held, total - first
    if need > kv.allocator.available_pages():
        kv.tree.evict(need - kv.allocator.available_pages())
    if tail > swa.allocator.available_pages():
        kv.tree.evict_swa(tail - swa.allocator.available_pages())
    if need > kv.allocator.available_pages() or tail > swa.allocator.available_pages():
        return False
    pages = kv.allocator.alloc(need) if need else []
    if pages is None:
        return False
    if not swa.alloc_for(pages[first - held:]):
        kv.allocator.free(pages)
        return False
    req.pages.extend(pages)
    req.swa_evicted_pages = first
    return True


def held_tail_pages(kv: Any, req: Any, seq_len: int) -> int:
    """How many of the prompt's last-window pages lie in the request's tree prefix (the
    decode holds their SWA pages: `prefix_swa_pages` on the wire, which the prefill skips)."""
    first = tail_start_page(seq_len, kv.swa.window, kv.page_size)
    held = min(req.num_tree_pages, -(-seq_len // kv.page_size))
    dead = [i for i in range(first, held) if not kv.swa.map[req.pages[i]]]
    assert not dead, f"{req.rid}: prefix pages #{dead} in its last window have no SWA page"
    return max(held - first, 0)


def decode_tail_wire_ids(kv: Any, req: Any, seq_len: int) -> list[int]:
    """The wire ids of the SWA pages `grow_swa_tail` gave the request (prompt order)."""
    first = max(tail_start_page(seq_len, kv.swa.window, kv.page_size), req.num_tree_pages)
    base = swa_base(kv.plan.num_pages)
    return [base + kv.swa.map[p] for p in req.pages[first:-(-seq_len // kv.page_size)]]


__all__ = ["decode_tail_wire_ids", "grow_swa_tail", "held_tail_pages", "prefill_tail_wire_ids",
           "swa_base", "tail_start_page"]
