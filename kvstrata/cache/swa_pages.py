"""Hybrid SWA memory, the page side (no torch): a second page pool for the sliding-window
layers, mapped from the canonical full pages (SGLang's SWATokenToKVPoolAllocator).

With `KVPlan.has_swa_pool`, full-attention layers keep their K/V in the main pool and the
sliding-window layers in a smaller SWA pool. Full page ids stay the one address of a token
(req.pages, req_to_token, tree nodes' device_pages); `map[full_page]` is the SWA page that
holds the same tokens for the window layers, 0 when there is none (freed because it fell out
of every window, or never held). Every full page allocated for a request gets an SWA page at
once, so capacity is the smaller of the two free counts; freeing a full page frees its SWA
page. The SWA page of a position may go early: a query at position q of a layer with window
W reads only positions q-W+1..q (runner/attention/window.py), so once a request has computed
past a page by more than a window, no query of its own ever reads that page's SWA KV again.

Who owns an SWA page is who owns its full page: a request (its own pages), or the radix tree
(cache/swa_radix.py), which may drop SWA pages of cached nodes on its own ("tombstones").

Per-request state (duck-typed, like the rest of the request's KV state; cache/ must not import
engine/): `swa_evicted_pages`, the leading pages whose SWA the request itself has given up (it
only ever frees pages it owns, i.e. from num_tree_pages on), and `swa_lock_from`, the position
where its SWA lock on its tree prefix starts (None: it holds none).
"""
from __future__ import annotations

from typing import Any

from kvstrata.cache.page_allocator import PageAllocator


class SWAPages:
    """The SWA page allocator plus the full -> SWA page map."""

    def __init__(self, num_swa_pages: int, num_full_pages: int, page_size: int, window: int):
        if window < 1:
            raise ValueError(f"an SWA pool needs a window of at least one token, got {window}")
        self.allocator = PageAllocator(num_swa_pages, page_size)
        self.page_size = page_size
        self.window = window
        # A list, not a dict: O(1) by full page id, and 0 reads as "no SWA page".
        self.map = [0] * (num_full_pages + 1)
        # Whole pages before a query position that its window may reach: the query at q
        # reads q-W+1..q, i.e. W-1 earlier tokens. A prefix of L tokens (L page-aligned) is
        # usable, and a lock protects, the last `window_pages` pages before L.
        self.window_pages = -(-(window - 1) // page_size)
        # The most SWA tokens a decoding request holds: after release_upto(C) and growing to
        # C + 1 tokens it keeps pages [floor((C-W-P)/P), ceil((C+1)/P)), at most
        # ceil((W+1)/P) + 2 of them (the window, the release margin, the page being filled).
        self.per_request_tokens = (-(-(window + 1) // page_size) + 2) * page_size

    def lone_request_tokens(self, prompt_len: int) -> int:
        """SWA tokens a request of `prompt_len` tokens needs at once, alone (chunked as small
        as a page), to compute its prompt and its first output token (the full pool's check
        counts the same, prompt + 1): a short one all their pages; a long one its window's
        pages, the page being written and the release margin's -- at a chunk edge or decode
        step q it holds pages [floor((q-W-P)/P), ceil((q+1)/P)), at most ceil(W/P) + 2
        (`per_request_tokens` rounds W + 1 up instead: an upper bound, not the least). A
        prompt a page or so over it with a one-token generation could still finish: it is
        refused all the same, as the full pool's n + 1 check refuses one of the pool's size."""
        P = self.page_size
        return min(-(-(prompt_len + 1) // P), -(-self.window // P) + 2) * P

    # ------------------------------------------------------------------ pages
    def live(self, full_page: int) -> bool:
        return self.map[full_page] != 0

    def alloc_for(self, full_pages: list[int]) -> bool:
        """Give each of these (fresh) full pages an SWA page; all or nothing."""
        swa = self.allocator.alloc(len(full_pages))
        if swa is None:
            return False
        for full, page in zip(full_pages, swa):
            assert self.map[full] == 0, f"full page {full} already has SWA page {self.map[full]}"
            self.map[full] = page
        return True

    def free_swa(self, full_pages: list[int]) -> int:
        """Free the SWA pages of these full pages (those that have one); return how many."""
        swa = [self.map[p] for p in full_pages if self.map[p]]
        if swa:
            self.allocator.free(swa)
            for p in full_pages:
                self.map[p] = 0
        return len(swa)

    def adopt(self, dst_full: int, src_full: int) -> None:
        """Move src's SWA page to dst (a tree node healed by a request's live copy of the
        same tokens; src is then freed as a duplicate, without an SWA page)."""
        assert self.map[dst_full] == 0 and self.map[src_full] != 0, (dst_full, src_full)
        self.map[dst_full], self.map[src_full] = self.map[src_full], 0

    def slots(self, pages: list[int], start: int, end: int) -> list[int]:
        """SWA slot of each position in [start, end); 0 where its page has no SWA page."""
        P, m = self.page_size, self.map
        out = []
        for i in range(start, end):
            swa = m[pages[i // P]]
            out.append(swa * P + i % P if swa else 0)
        return out

    # ------------------------------------------------------------------ requests
    def release_upto(self, num_computed_tokens: int) -> int:
        """Pages [0, n) lie wholly before every window a request that has computed
        `num_computed_tokens` tokens will read again (with one page of margin, as SGLang's
        `seq_len - window - page_size`): their SWA KV can go."""
        return max(num_computed_tokens - self.window - self.page_size, 0) // self.page_size

    def release(self, tree, req: Any) -> None:
        """A running request's SWA pages that no query of its own reads again: free those of
        its own pages, and drop its SWA lock once its tree prefix is behind every window
        (the tree's pages then follow the tree's rules: cached, evictable). O(pages
        released); num_computed_tokens must be settled (the scheduler calls it before
        scheduling: a verify's rejected drafts are rolled back by then)."""
        if not req.pages:
            return
        upto = min(self.release_upto(req.num_computed_tokens), len(req.pages))
        start = max(getattr(req, "swa_evicted_pages", 0), req.num_tree_pages)
        if upto > start:
            self.free_swa(req.pages[start:upto])
        req.swa_evicted_pages = max(start, upto)
        lock_from = getattr(req, "swa_lock_from", None)
        if lock_from is None or upto * self.page_size <= lock_from:
            return
        # The window left part of the locked tree window: lock only the rest (or nothing),
        # so the request never pins more than per_request_tokens.
        self.unlock(tree, req)
        end = req.num_tree_pages * self.page_size
        if upto * self.page_size < end:
            tree.swa_lock(req.last_node, end, upto * self.page_size)
            req.swa_lock_from = upto * self.page_size

    def lock(self, tree, req: Any) -> None:
        """SWA-lock the last window of the request's tree prefix (after its full lock)."""
        if req.last_node is not None:
            end = req.num_tree_pages * self.page_size
            start = end - min(self.window_pages, req.num_tree_pages) * self.page_size
            tree.swa_lock(req.last_node, end, start)
            req.swa_lock_from = start

    def unlock(self, tree, req: Any) -> None:
        """Drop the request's SWA lock, if it holds one (before its full unlock)."""
        start = getattr(req, "swa_lock_from", None)
        if start is not None:
            tree.swa_unlock(req.last_node, req.num_tree_pages * self.page_size, start)
            req.swa_lock_from = None

    def own_live_pages(self, req: Any) -> list[int]:
        """The request's own pages that still hold an SWA page."""
        return req.pages[max(req.num_tree_pages, getattr(req, "swa_evicted_pages", 0)):]

    def held_tokens(self, req: Any) -> int:
        """SWA tokens the request pins: its own live pages and its SWA-locked tree window."""
        held = len(self.own_live_pages(req)) * self.page_size
        lock_from = getattr(req, "swa_lock_from", None)
        if lock_from is not None:
            held += req.num_tree_pages * self.page_size - lock_from
        return held

    def check_requests(self, live_requests: list[Any], tree) -> None:
        """Every mapped SWA page is owned exactly once -- by one request's own page or one
        cached node -- and free + owned == total; a request's live own pages and the pages
        its next query may read are mapped."""
        alloc = self.allocator
        alloc.check_integrity()
        owned: list[int] = []
        for node in tree.nodes():
            owned += [self.map[p] for p in node.device_pages if self.map[p]]
        for req in live_requests:
            mine = req.pages[req.num_tree_pages:]
            evicted = getattr(req, "swa_evicted_pages", 0)
            for i, page in enumerate(mine, req.num_tree_pages):
                if i >= evicted:
                    assert self.map[page], f"{req.rid}: own page {page} (#{i}) lost its SWA page"
                if self.map[page]:
                    owned.append(self.map[page])
            # What the next query (at num_computed_tokens) reads must be there.
            first = max(req.num_computed_tokens - self.window + 1, 0) // self.page_size
            upto = min(-(-req.num_computed_tokens // self.page_size), len(req.pages))
            dead = [i for i in range(first, upto) if not self.map[req.pages[i]]]
            assert not dead, (f"{req.rid}: pages #{dead} inside its window (computed "
                              f"{req.num_computed_tokens}, window {self.window}) have no SWA page")
        assert len(set(owned)) == len(owned), "an SWA page is mapped from two full pages"
        assert all(alloc.is_allocated(p) for p in owned), "a mapped SWA page is free"
        # (A full page freed without its SWA page leaves a used SWA page nobody owns: the
        # count below catches it without scanning the whole map.)
        free = alloc.available_pages()
        assert free + len(owned) == alloc.num_pages, (
            f"SWA page leak: free {free} + owned {len(owned)} != total {alloc.num_pages}")
