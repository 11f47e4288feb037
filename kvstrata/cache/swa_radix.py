"""The radix tree with hybrid SWA memory (no torch): SGLang's SWARadixCache semantics over
kvstrata's page tree (our own code).

A cached node keeps its full pages as in RadixCache; the SWA pages of those full pages
(cache/swa_pages.py, `swa.map`) may be dropped on their own. A node whose SWA pages are gone
is a *tombstone*: its tokens still count as a cached prefix for the full layers, but no query
may read the window layers there. Each node is all-live or all-tombstoned (splits keep it so).

Matching: a hit of L tokens is usable only if the pages covering positions
[L - window + 1, L) have SWA pages (the first recomputed query, at L, reads them), or L == 0.
The match is cut back to the longest usable page-aligned length; the rest is recomputed.

Locks: `lock_ref` (full pages) runs from a request's node to the root, as before. The SWA
lock (`swa_lock_ref`) covers only the last `window_pages` pages of its prefix -- the part its
queries can still read -- and the node at the window's start is split so exactly those pages
are protected; long cached prompts do not pin SWA memory. As the request's window moves on
the lock shrinks page by page, and goes once the window has left the prefix. A request remembers where its SWA
lock starts (a position), so splits inside the locked span after the lock need no bookkeeping:
both halves of a split node inherit swa_lock_ref, and unlock walks up to that position.

SWA eviction (`evict_swa`, when the SWA pool is short): LRU over the nodes with live, unlocked
SWA pages, shallower first on equal stamps (keep the deep ends of long prefixes usable). An
unlocked leaf goes entirely (a tombstoned leaf can end no usable match), then any tombstoned
ancestors left as unlocked leaves; any other node is tombstoned. Full eviction (`evict`) frees
the SWA pages of the leaves it drops.

Insert: new pages become nodes split by liveness (a request whose early SWA pages were freed
inserts a tombstoned head and a live tail). Where the tree has a tombstone and the caller
brings live SWA pages for the same tokens, the node adopts them (healing; the caller then
frees its duplicate full pages, which no longer have SWA pages); where both are live, the
caller's duplicates are freed with their SWA pages. Nothing leaks either way.
"""
from __future__ import annotations

import heapq

from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.radix_cache import MatchResult, RadixCache, TreeNode
from kvstrata.cache.swa_pages import SWAPages


class SWARadixCache(RadixCache):
    def __init__(self, allocator: PageAllocator, page_size: int, swa: SWAPages,
                 disable: bool = False, eviction_policy: str = "lru"):
        self.swa = swa
        # Cumulative, for stats and tests: tokens cut from matches by tombstones, tombstoned
        # pages healed by an insert.
        self.total_cut_tokens = 0
        self.total_healed_pages = 0
        super().__init__(allocator, page_size, disable=disable, eviction_policy=eviction_policy)

    def _init_tree(self) -> None:
        super()._init_tree()
        # SWA pages of live nodes, unlocked / SWA-locked (tombstones hold none).
        self._swa_evictable_pages = 0
        self._swa_protected_pages = 0

    # ------------------------------------------------------------------ match
    def _usable_pages(self, token_ids: list[int]) -> int:
        """Whole pages of the longest cached prefix whose last window is live (read-only)."""
        if self.disable:
            return 0
        P, need = self.page_size, self.swa.window_pages
        usable = len(token_ids) - len(token_ids) % P
        node, pos, total, run, best = self.root, 0, 0, 0, 0
        while pos < usable:
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None:
                break
            matched = self.matching_pages(child.key, token_ids, pos, usable)
            if child.swa_tombstone:
                run = 0
            else:
                # Within a live node the condition only gets easier page by page, so its
                # last matched page is the best end it offers.
                run += matched
                if run >= min(need, total + matched):
                    best = total + matched
            total += matched
            if matched < child.num_pages:
                break
            pos += matched * P
            node = child
        return best

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """RadixCache.match_prefix cut back to the longest usable prefix (module docstring)."""
        keep = self._usable_pages(token_ids) * self.page_size
        match = super().match_prefix(token_ids[:keep])
        self.total_queried_tokens += len(token_ids) - keep  # the cut tail was queried too
        if not self.disable:
            self.total_cut_tokens += super().peek_device_pages(token_ids) * self.page_size - keep
        return match

    def peek_device_pages(self, token_ids: list[int]) -> int:
        return self._usable_pages(token_ids)

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: list[int], pages: list[int]) -> int:
        """RadixCache.insert (same return value and caller duties), with tombstone healing
        and new nodes split by SWA liveness (module docstring)."""
        P = self.page_size
        if len(token_ids) != len(pages) * P:
            raise ValueError(
                f"insert needs whole pages: {len(token_ids)} tokens != {len(pages)} pages * {P}")
        if self.disable:
            return 0
        if 0 in pages:
            raise ValueError("page 0 is the padding sink and cannot be cached")
        now = self.tick()
        node = self.root
        node.last_access_time = now
        pos = 0
        while pos < len(token_ids):
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None:
                self._add_nodes(node, token_ids, pages, pos, now)
                break
            matched = self.matching_pages(child.key, token_ids, pos, len(token_ids))
            first = pos // P
            heal = [False] * matched
            if child.swa_tombstone:
                heal = [pages[first + i] != child.device_pages[i] and self.swa.live(pages[first + i])
                        for i in range(matched)]
            # Take one run of equal healing need at a time, so a node is healed whole.
            run = 1
            while run < matched and heal[run] == heal[0]:
                run += 1
            if run < child.num_pages and (heal[0] or pos + run * P < len(token_ids)):
                child = self.split_node(child, run)
            if heal[0]:
                for full, mine in zip(child.device_pages, pages[first:first + run]):
                    self.swa.adopt(full, mine)
                child.swa_tombstone = False
                self._swa_evictable_pages += child.num_pages  # a tombstone holds no lock
                self.total_healed_pages += child.num_pages
            pos += run * P
            child.last_access_time = now
            node = child
        return pos // P

    def _add_nodes(self, parent: TreeNode, token_ids: list[int], pages: list[int], pos: int,
                   now: int) -> None:
        self.add_swa_nodes(parent, token_ids, pages, pos, now)

    def add_swa_nodes(self, parent: TreeNode, token_ids: list[int], pages: list[int], pos: int,
                      now: int) -> list[TreeNode]:
        """The part of an insert the tree lacked: a chain of new nodes under `parent`, one per
        run of pages with / without SWA pages (a node is live or a tombstone as a whole).
        An insert step, public only so SWAHiRadixCache can share it (it backs the new nodes
        up); returns them in order."""
        P = self.page_size
        i = pos // P
        added = []
        while i < len(pages):
            live = self.swa.live(pages[i])
            j = i + 1
            while j < len(pages) and self.swa.live(pages[j]) == live:
                j += 1
            node = TreeNode(tuple(token_ids[i * P:j * P]), list(pages[i:j]), parent, now)
            node.swa_tombstone = not live
            parent.children[node.key[:P]] = node
            self._evictable_pages += node.num_pages
            if live:
                self._swa_evictable_pages += node.num_pages
            added.append(node)
            parent, i = node, j
        return added

    def split_node(self, child: TreeNode, num_pages: int) -> TreeNode:
        upper = super().split_node(child, num_pages)
        # Every SWA lock on child covers all of it (locks start at node boundaries), so it
        # covers both halves; liveness is per node.
        upper.swa_lock_ref = child.swa_lock_ref
        upper.swa_tombstone = child.swa_tombstone
        return upper

    # ------------------------------------------------------------------ SWA locks
    def swa_lock(self, node: TreeNode, end: int, start: int) -> None:
        """SWA-lock positions [start, end) (page-aligned) of the prefix ending at `node`
        (`end` tokens deep): the pages a request's windows still read there."""
        P = self.page_size
        pos = end
        while pos > start:
            node_start = pos - len(node.key)
            if node_start < start:
                self.split_node(node, (start - node_start) // P)  # node keeps the lower half
                node_start = start
            assert not node.swa_tombstone, f"SWA lock on a tombstone {node!r}"
            if node.swa_lock_ref == 0:
                self._swa_evictable_pages -= node.num_pages
                self._swa_protected_pages += node.num_pages
            node.swa_lock_ref += 1
            pos, node = node_start, node.parent

    def swa_unlock(self, node: TreeNode, end: int, start: int) -> None:
        pos = end
        while pos > start:
            pos -= len(node.key)
            assert pos >= start, f"SWA lock span not at a node boundary ({pos} < {start})"
            if node.swa_lock_ref <= 0:
                raise ValueError(f"SWA unlock of an unlocked node {node!r}")
            node.swa_lock_ref -= 1
            if node.swa_lock_ref == 0:
                self._swa_protected_pages -= node.num_pages
                self._swa_evictable_pages += node.num_pages
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def _free_node_pages(self, node: TreeNode) -> None:
        if not node.swa_tombstone:
            self.swa.free_swa(node.device_pages)
            if node.swa_lock_ref:
                self._swa_protected_pages -= node.num_pages
            else:
                self._swa_evictable_pages -= node.num_pages
        super()._free_node_pages(node)

    def evict_swa(self, num_pages: int) -> int:
        """Free at least `num_pages` SWA pages of cached nodes without an SWA lock (module
        docstring); return SWA pages freed (fewer only when nothing is left to free)."""
        if num_pages <= 0 or self.disable:
            return 0
        heap = []
        stack = [(child, 1) for child in self.root.children.values()]
        while stack:
            node, depth = stack.pop()
            if not node.swa_tombstone and node.swa_lock_ref == 0:
                heap.append((self._priority(node), depth, node.id, node))
            stack.extend((c, depth + 1) for c in node.children.values())
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            node = heapq.heappop(heap)[-1]
            if node.parent is None or node.swa_tombstone:
                continue  # dropped with a leaf below it meanwhile
            freed += node.num_pages
            if node.children or node.lock_ref:
                self.swa.free_swa(node.device_pages)
                node.swa_tombstone = True
                self._swa_evictable_pages -= node.num_pages
                continue
            parent = node.parent
            self._drop_leaf(node)
            # Tombstoned ancestors left childless and unlocked can end no usable match.
            while (parent is not self.root and not parent.children and not parent.lock_ref
                   and parent.swa_tombstone):
                node, parent = parent, parent.parent
                self._drop_leaf(node)
        return freed

    def evictable_swa_pages(self) -> int:
        return self._swa_evictable_pages

    def protected_swa_pages(self) -> int:
        return self._swa_protected_pages

    def cached_swa_pages(self) -> int:
        return self._swa_evictable_pages + self._swa_protected_pages

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        super().check_integrity()
        evictable = protected = 0
        for node in self.nodes():
            swa = [self.swa.map[p] for p in node.device_pages]
            assert node.swa_lock_ref <= node.lock_ref, f"{node!r}: SWA lock without a full lock"
            if node.swa_tombstone:
                assert not any(swa), f"{node!r}: tombstone maps to SWA pages {swa}"
                assert node.swa_lock_ref == 0, f"{node!r}: SWA-locked tombstone"
                continue
            assert all(swa), f"{node!r}: live node has pages without an SWA page: {swa}"
            if node.swa_lock_ref:
                protected += node.num_pages
            else:
                evictable += node.num_pages
        assert (evictable, protected) == (self._swa_evictable_pages, self._swa_protected_pages), (
            f"SWA counters (evictable={self._swa_evictable_pages}, protected="
            f"{self._swa_protected_pages}) != tree (evictable={evictable}, protected={protected})")
