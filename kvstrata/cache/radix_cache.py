"""Radix tree over token ids whose nodes own device KV pages (page-aligned prefix cache).

Every node key is a tuple of token ids whose length is a multiple of page_size, and the node
owns exactly one page per page_size tokens (`device_pages`). Matching and inserting therefore
work in whole pages only: a partially filled trailing page is never shared, because its KV
slots would be overwritten by whoever owns the page next.

Residency: here a node's pages live on the device only; HiRadixCache (hiradix_cache.py) adds
`host_pages`, and a split cuts both lists at the same page offset.

Locks: `lock_ref` counts the locks whose path passes through the node (a lock on node X pins
X and every ancestor). Pages of nodes with lock_ref > 0 are "protected", the others
"evictable"; the two counters are kept in step on lock/unlock/insert/evict so the scheduler
can read `available + evictable` in O(1).

Access clock: a logical counter bumped once per match/insert; every node on the touched path
gets the same stamp. Ancestors are always on the path of their descendants, so a parent's
stamp is never older than its children's, and equal-stamp leaves are broken by creation id:
eviction order is fully deterministic.

The node class (TreeNode) and MatchResult: cache/tree_node.py (re-exported here).
"""
from __future__ import annotations

import heapq
from typing import Iterator

from kvstrata.cache.eviction import get_priority_fn
from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.radix_checks import check_device_tree, check_tree_shape
from kvstrata.cache.tree_node import MatchResult, TreeNode  # noqa: F401 (re-exported)


class RadixCache:
    """Page-aligned prefix cache. Contract for callers (the scheduler):

    - `match_prefix` never allocates or frees; it may split a node so that `last_node` ends
      exactly at the match. The returned pages are only safe to use after `lock(last_node)`.
    - `insert` adopts the caller's pages for the part of the key the tree did not have and
      returns how many leading pages it already had (see `insert` for the region table).
    - `evict(n)` only frees pages of unlocked leaves; `evict(0)` is always safe.
    - With `disable=True` the tree stays empty: `match_prefix` returns ([], root), `insert`
      adopts nothing and returns 0 (so the caller frees ALL pages it passed), `evict`
      frees nothing, and every page counter is 0.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, disable: bool = False,
                 eviction_policy: str = "lru"):
        if allocator.page_size != page_size:
            raise ValueError(f"allocator page_size {allocator.page_size} != cache page_size {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.eviction_policy = eviction_policy
        self._priority = get_priority_fn(eviction_policy)
        self._clock = 0
        # Cumulative for metrics (counters only go up, so flush does not reset them).
        self.total_queried_tokens = 0
        self.total_matched_tokens = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode()
        # The root is permanently "locked" so lock/unlock/evict walks stop at it.
        self.root.lock_ref = 1
        self._evictable_pages = 0
        self._protected_pages = 0

    def tick(self) -> int:
        """A fresh access stamp (a logical clock) for the nodes a walk touches; the storage
        tier stamps the host-only nodes it hangs under the tree with it too."""
        self._clock += 1
        return self._clock

    def page_key(self, tokens, start: int) -> tuple[int, ...]:
        """The key a child is filed under: the page of `tokens` starting at `start`."""
        return tuple(tokens[start:start + self.page_size])

    def matching_pages(self, key: tuple[int, ...], tokens: list[int], start: int, end: int) -> int:
        """Number of whole pages at the start of `key` equal to tokens[start:end]."""
        limit = min(len(key), end - start)
        i = 0
        while i < limit and key[i] == tokens[start + i]:
            i += 1
        return i // self.page_size

    # ------------------------------------------------------------------ match / insert

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """Longest cached prefix of `token_ids`, in whole pages.

        A match ending inside a node splits it, so `last_node` covers exactly the match and
        locking it pins nothing beyond. Matched nodes get a fresh access stamp and hit_count+1;
        the unmatched tail of a split node keeps its old stamp (it becomes older, so it goes first).
        Every call counts towards the hit-rate stats, including repeated calls for one request.
        """
        self.total_queried_tokens += len(token_ids)
        if self.disable:
            return MatchResult([], self.root)
        page_size = self.page_size
        # Only whole pages can match: drop the partial trailing page.
        usable = len(token_ids) - len(token_ids) % page_size
        now = self.tick()
        node = self.root
        node.last_access_time = now
        pages: list[int] = []
        pos = 0  # tokens matched so far
        while pos < usable:
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None:
                break
            matched = self.matching_pages(child.key, token_ids, pos, usable)  # >= 1
            if matched < child.num_pages:
                # The match ends inside `child`. After the split the loop stops by itself:
                # the tail's first page differs from the next query page (or the query ended).
                child = self.split_node(child, matched)
            child.last_access_time = now
            child.hit_count += 1
            pages.extend(child.device_pages)
            pos += matched * page_size
            node = child
        self.total_matched_tokens += pos
        return MatchResult(pages, node)

    def peek_device_pages(self, token_ids: list[int]) -> int:
        """Whole pages of `token_ids` cached on the device, read-only (see match_prefix)."""
        if self.disable:
            return 0
        usable = len(token_ids) - len(token_ids) % self.page_size
        node, pos, pages = self.root, 0, 0
        while pos < usable:
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None or not child.device_pages:
                break
            matched = self.matching_pages(child.key, token_ids, pos, usable)
            pages += matched
            if matched < len(child.key) // self.page_size:
                break
            pos += matched * self.page_size
            node = child
        return pages

    def insert(self, token_ids: list[int], pages: list[int]) -> int:
        """Cache `pages` as the KV of `token_ids`; return how many leading pages the tree had.

        len(token_ids) must equal len(pages) * page_size (whole pages only). With
        k = return value and n = len(pages):

            pages index:  [0 ........ prefix) [prefix ........ k) [k ............ n)
                          from match_prefix:   caller computed;     adopted by the tree:
                          the tree's own ids   the tree already     now cached, the caller
                          (same ids; leave     has a copy -> these  must not free them
                          them alone)          are duplicates: the
                                               CALLER frees them

        where prefix = len(MatchResult.device_pages) of the match the caller holds locked
        (0 if none). Pages in [0, k) that are the tree's own ids must not be freed.
        Disabled cache: returns 0 and adopts nothing -- the caller frees all n pages itself.
        """
        page_size = self.page_size
        if len(token_ids) != len(pages) * page_size:
            raise ValueError(
                f"insert needs whole pages: {len(token_ids)} tokens != {len(pages)} pages * {page_size}"
            )
        if self.disable:
            return 0
        if 0 in pages:
            raise ValueError("page 0 is the padding sink and cannot be cached")
        now = self.tick()
        node = self.root
        node.last_access_time = now
        pos = 0  # tokens already present in the tree along the path
        while pos < len(token_ids):
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None:
                # The rest is new: one leaf adopts the remaining pages.
                leaf = TreeNode(tuple(token_ids[pos:]), list(pages[pos // page_size:]), node, now)
                node.children[leaf.key[:page_size]] = leaf
                # A fresh leaf has lock_ref 0 even under a locked parent: the caller's lock
                # covers only the prefix it matched.
                self._evictable_pages += leaf.num_pages
                break
            matched = self.matching_pages(child.key, token_ids, pos, len(token_ids))  # >= 1
            pos += matched * page_size
            if matched < child.num_pages and pos < len(token_ids):
                # Diverges inside `child`: cut it so the new branch hangs at the divergence.
                # (When the key simply ends inside `child`, no split is needed.)
                child = self.split_node(child, matched)
            child.last_access_time = now
            node = child
        # pos stops at the first token the tree lacked (== len(token_ids) if it had them all).
        return pos // page_size

    def match_inserted(self, token_ids: list[int]) -> MatchResult:
        """The path of a key whose pages were just inserted, its last node ending exactly at
        the key's end (cache_unfinished locks it): match_prefix, which the state tree
        narrows to snapshots (cache/state_radix.py) and so overrides here."""
        return self.match_prefix(token_ids)

    def split_node(self, child: TreeNode, num_pages: int) -> TreeNode:
        """Cut `child` after `num_pages` pages; return the new upper node.

            before:  parent -> child[key = A + B, pages = a + b]
            after:   parent -> upper[A, a] -> child[B, b]       (len(a) == num_pages)

        `upper` inherits lock_ref (every lock through child also runs through upper), hit_count
        and access stamp, so protected/evictable counters and eviction order are unchanged.
        With host residency, host_pages would be cut at the same offset.
        """
        cut = num_pages * self.page_size
        parent = child.parent
        upper = TreeNode(child.key[:cut], child.device_pages[:num_pages], parent, child.last_access_time)
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        # Host residency is cut at the same page; a pending write now covers both halves.
        if child.host_pages is not None:
            upper.host_pages = child.host_pages[:num_pages]
            child.host_pages = child.host_pages[num_pages:]
        if child.pending_host is not None:
            upper.pending_job = child.pending_job
            upper.pending_host = child.pending_host[:num_pages]
            child.pending_host = child.pending_host[num_pages:]
            self._on_split_pending(upper, child)
        if child.hash_keys is not None:
            upper.hash_keys = child.hash_keys[:num_pages]
            child.hash_keys = child.hash_keys[num_pages:]
        if child.host_ref:
            upper.host_ref = child.host_ref  # a backup reading child's pages reads upper's too
            self._on_split_host_ref(upper, child)
        child.key = child.key[cut:]
        child.device_pages = child.device_pages[num_pages:]
        child.parent = upper
        upper.children[child.key[:self.page_size]] = child
        parent.children[upper.key[:self.page_size]] = upper  # same first page as before
        return upper

    def _on_split_pending(self, upper: TreeNode, lower: TreeNode) -> None:
        """Hook for HiCache: a node with a write in flight was split."""

    def _on_split_host_ref(self, upper: TreeNode, lower: TreeNode) -> None:
        """Hook for HiCache L3: a node whose host copy is being backed up was split."""

    # ------------------------------------------------------------------ locks

    def lock(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors (not root): they cannot be evicted until unlocked."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_pages -= node.num_pages
                self._protected_pages += node.num_pages
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_pages -= node.num_pages
                self._evictable_pages += node.num_pages
            node = node.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, in policy order; return pages freed.

        Whole leaves are evicted, so it may free more than asked; it frees fewer only when
        nothing evictable is left. A parent whose last child goes becomes a candidate itself.
        num_pages <= 0 frees nothing. Cost: one tree walk plus O(log n) per evicted node.
        """
        if num_pages <= 0 or self.disable:
            return 0
        heap = [(self._priority(n), n.id, n) for n in self.nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            freed += leaf.num_pages
            parent = leaf.parent
            self._drop_leaf(leaf)
            # root has lock_ref 1 permanently, so it is never pushed.
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), parent.id, parent))
        return freed

    def _drop_leaf(self, leaf: TreeNode) -> None:
        """Free an unlocked leaf's pages and take it out of the tree."""
        self._free_node_pages(leaf)
        self._evictable_pages -= leaf.num_pages  # unlocked: evictable
        del leaf.parent.children[leaf.key[:self.page_size]]
        leaf.parent = None

    def evictable_pages(self) -> int:
        return self._evictable_pages

    def protected_pages(self) -> int:
        return self._protected_pages

    def cached_pages(self) -> int:
        return self._evictable_pages + self._protected_pages

    def reset(self) -> bool:
        """Flush: free every cached page. Refuses (returns False, changes nothing) while any
        node is locked, because a running request still reads those pages."""
        if self._protected_pages > 0 or any(n.lock_ref > 0 for n in self.nodes()):
            return False
        for node in self.nodes():
            if node.device_pages:
                self._free_node_pages(node)
        self._init_tree()
        return True

    def _free_node_pages(self, node: TreeNode) -> None:
        """Give a dropped node's device pages back (the SWA tree frees their SWA pages too)."""
        self.allocator.free(node.device_pages)

    # ------------------------------------------------------------------ introspection

    def hit_rate(self) -> float:
        """Matched / queried tokens over all match_prefix calls (0.0 before any query)."""
        if self.total_queried_tokens == 0:
            return 0.0
        return self.total_matched_tokens / self.total_queried_tokens

    def nodes(self) -> Iterator[TreeNode]:
        """All non-root nodes, depth first (iterative: deep trees must not hit the recursion limit)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_tree_shape(self) -> None:
        """The structural invariants of any radix tree (radix_checks.py)."""
        check_tree_shape(self)

    def check_integrity(self) -> None:
        """Raise AssertionError if the tree, its counters or the allocator disagree."""
        check_device_tree(self)
