"""The radix tree of a model with recurrent state (no torch): SGLang's MambaRadixCache semantics
over kvstrata's page tree (our own code).

A recurrent layer's state is valid at exactly one position, so a cached prefix is usable only
where the state after its last token was kept. A node keeps its full-attention pages as in
RadixCache plus, optionally, a *snapshot*: a state pool slot (`state_slot`) holding the state
after the node's last token. Snapshots are made where a request finished (it donates its
working slot, or its last tracked snapshot), where a prefill chunk ended, and at extra_buffer's
track points (cache/state_slots.py decides; `attach_state` files them). A node without one is a
*state tombstone*: its K/V still serves the full-attention layers of anyone who resumes past
it, but no match may end there. Splitting a node leaves the upper half a tombstone (the state
at the cut was never kept); the lower half keeps the node's snapshot (same end).

Matching stops at the last node WITH a snapshot: `match_prefix` returns that prefix (whole
nodes); a hit copies the snapshot into the request's own slot (copy-on-write: the tree's slot
is never written by a forward). Until that copy is made, at the next forward, the node's
snapshot is pinned (`state_pin`) so that no eviction frees it in between.

Eviction: full-attention eviction (`evict`) drops unlocked leaves, snapshot-less ones first
(no match can end at them), and frees their snapshots with their pages. State eviction
(`evict_states`, when the state pool is short) walks the unpinned snapshots in policy order:
an unlocked leaf goes entirely (its K/V cannot be resumed without its state), then any
ancestors left as unlocked snapshot-less leaves; any other node (an inner node, or one on a
running request's locked path) only loses its snapshot and becomes a tombstone.
"""
from __future__ import annotations

import heapq

from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.radix_cache import MatchResult, RadixCache, TreeNode


class StateRadixCache(RadixCache):
    def __init__(self, allocator: PageAllocator, page_size: int, slots: PageAllocator,
                 disable: bool = False, eviction_policy: str = "lru"):
        self.slots = slots  # the state pool's slot ids (one per snapshot)
        # Cumulative, for stats and tests: cached K/V tokens a match could not use (no
        # snapshot at their end), snapshots dropped by state eviction.
        self.total_state_cut_tokens = 0
        self.total_evicted_states = 0
        super().__init__(allocator, page_size, disable=disable, eviction_policy=eviction_policy)
        policy = self._priority
        self._state_priority = policy
        # Full-attention eviction: snapshot-less leaves first, then the policy's order.
        self._priority = lambda node: (node.state_slot != 0,) + policy(node)

    def _init_tree(self) -> None:
        super()._init_tree()
        self._num_states = 0
        self._num_pinned = 0

    # ------------------------------------------------------------------ match
    def _resumable_pages(self, token_ids: list[int]) -> int:
        """Whole pages of the longest cached prefix ending at a node with a snapshot
        (read-only)."""
        if self.disable:
            return 0
        P = self.page_size
        usable = len(token_ids) - len(token_ids) % P
        node, pos, best = self.root, 0, 0
        while pos < usable:
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None:
                break
            if self.matching_pages(child.key, token_ids, pos, usable) < child.num_pages:
                break  # the match ends inside the node: its snapshot is at its end
            pos += len(child.key)
            node = child
            if child.state_slot:
                best = pos // P
        return best

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """RadixCache.match_prefix cut back to the last node with a snapshot."""
        keep = self._resumable_pages(token_ids) * self.page_size
        if not self.disable:
            self.total_state_cut_tokens += super().peek_device_pages(token_ids) * \
                self.page_size - keep
        match = super().match_prefix(token_ids[:keep])
        self.total_queried_tokens += len(token_ids) - keep  # the cut tail was queried too
        return match

    def peek_device_pages(self, token_ids: list[int]) -> int:
        return self._resumable_pages(token_ids)

    def peek_kv_pages(self, token_ids: list[int]) -> int:
        """Whole pages of `token_ids` whose K/V is cached, snapshots or not (read-only)."""
        return super().peek_device_pages(token_ids)

    def match_inserted(self, token_ids: list[int]) -> MatchResult:
        """The K/V path (RadixCache.match_prefix): a chunk's pages end where its snapshot
        goes, with or without one there yet."""
        return super().match_prefix(token_ids)

    # ------------------------------------------------------------------ snapshots
    def node_at(self, token_ids: list[int]) -> TreeNode | None:
        """The node ending exactly after `token_ids` (whole pages, all cached), splitting the
        node that holds its end; None when the tree lacks them. No access stamp, no stats."""
        P = self.page_size
        node, pos = self.root, 0
        while pos < len(token_ids):
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None:
                return None
            matched = self.matching_pages(child.key, token_ids, pos, len(token_ids))
            if matched < len(child.key) // P:  # (a host-only node holds no device pages)
                if pos + matched * P < len(token_ids):
                    return None
                child = self.split_node(child, matched)
            pos += matched * P
            node = child
        return node

    def attach_state(self, node: TreeNode, slot: int) -> bool:
        """File `slot` as the snapshot at `node`'s end. False (nothing changed: the caller
        frees its slot) where the node has one already."""
        if self.disable or node is self.root or node.state_slot:
            return False
        assert self.slots.is_allocated(slot), f"snapshot slot {slot} is free"
        node.state_slot = slot
        self._num_states += 1
        return True

    def take_state(self, node: TreeNode) -> int:
        """Hand the snapshot of `node`, pinned once (by the caller), over to the caller: the
        node becomes a tombstone. Returns the slot."""
        assert node.state_pin == 1, f"take of a snapshot pinned {node.state_pin} times"
        self.unpin_state(node)
        slot, node.state_slot = node.state_slot, 0
        self._num_states -= 1
        return slot

    def pin_state(self, node: TreeNode) -> None:
        assert node.state_slot, f"pin of a node without a snapshot {node!r}"
        node.state_pin += 1
        self._num_pinned += 1

    def unpin_state(self, node: TreeNode) -> None:
        if node.state_pin <= 0:
            raise ValueError(f"unpin of an unpinned snapshot {node!r}")
        node.state_pin -= 1
        self._num_pinned -= 1

    # ------------------------------------------------------------------ eviction
    def drop_state(self, node: TreeNode) -> None:
        """Free `node`'s unpinned snapshot slot (eviction; public so StateHiRadixCache can
        share it, as it shares the rest of the snapshot bookkeeping)."""
        assert not node.state_pin, f"a pinned snapshot would be freed: {node!r}"
        self.slots.free([node.state_slot])
        node.state_slot = 0
        self._num_states -= 1

    def _free_node_pages(self, node: TreeNode) -> None:
        if node.state_slot:
            self.drop_state(node)
        super()._free_node_pages(node)

    def evict_states(self, num_states: int) -> int:
        """Free at least `num_states` unpinned snapshots (module docstring); return how many
        were freed (fewer only when no unpinned one is left)."""
        if num_states <= 0 or self.disable:
            return 0
        heap = self.unpinned_snapshots()
        freed = 0
        while freed < num_states and heap:
            node = heapq.heappop(heap)[-1]
            if node.parent is None or not node.state_slot:
                continue  # dropped with a leaf below it meanwhile
            freed += 1
            if node.children or node.lock_ref:
                self.drop_state(node)
                continue
            parent = node.parent
            self._drop_leaf(node)
            while (parent is not self.root and not parent.children and not parent.lock_ref
                   and not parent.state_slot):
                node, parent = parent, parent.parent
                self._drop_leaf(node)
        self.total_evicted_states += freed
        return freed

    def unpinned_snapshots(self) -> list:
        """A heap of the nodes with an unpinned snapshot, in state eviction's order (shared
        with StateHiRadixCache)."""
        heap = [(self._state_priority(n), n.id, n) for n in self.nodes()
                if n.state_slot and not n.state_pin]
        heapq.heapify(heap)
        return heap

    def cached_states(self) -> int:
        return self._num_states

    def pinned_states(self) -> int:
        return self._num_pinned

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        super().check_integrity()
        slots, pinned = [], 0
        for node in self.nodes():
            if node.state_pin:
                assert node.state_slot, f"{node!r}: pinned without a snapshot"
                assert node.lock_ref >= node.state_pin, f"{node!r}: pinned but not locked"
                pinned += node.state_pin
            if node.state_slot:
                assert self.slots.is_allocated(node.state_slot), (
                    f"{node!r}: snapshot slot {node.state_slot} is free")
                slots.append(node.state_slot)
        assert len(set(slots)) == len(slots), f"a snapshot slot is kept by two nodes: {slots}"
        assert (len(slots), pinned) == (self._num_states, self._num_pinned), (
            f"state counters (cached={self._num_states}, pinned={self._num_pinned}) != tree "
            f"(cached={len(slots)}, pinned={pinned})")
