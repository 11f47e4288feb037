"""HiCache L2 for a model with recurrent state (no torch): HiRadixCache's device/host page
residency plus StateRadixCache's state snapshots, each with a host copy (SGLang's
HiMambaRadixCache / its unified tree's FULL+MAMBA host pools; our own code).

Per node: `device_pages` / `host_pages` as in hiradix_cache.py; `state_slot` (a device state
pool slot holding the state after the node's last token, as in state_radix.py) and
`host_state` (a host state slot holding a copy of it). A snapshot is valid at one position
only, and a host copy of K/V pages alone cannot be resumed: a prefix is usable where the
state at its end is kept on either tier.

When a snapshot's device copy goes, it is written to a host state slot first, if the node
has a host copy of its pages (so a later hit can load both):
  - demotion (device eviction of a backed-up node, or write_back's write on eviction): the
    snapshot goes to the host with the pages;
  - state eviction (`evict_states`, the state pool short): the device copy is dropped, the
    host copy kept (the node's K/V stays on the device).
These writes are sync (a one-step TransferOp with state slot pairs and no pages), so they run
before the forward that may reuse the freed device slot; a state never changes once filed
(the state after the same tokens), so a node that has a host copy is not written again.
Without L3, writes at demotion time only, not with write_through's page writes: the snapshot
is usually filed after the pages were inserted, and a state slot is a few MiB that most nodes
never need on the host.

Host state slots are few (--hicache-mamba-size-gb): when none is free, host copies are
dropped, those whose node still holds its device snapshot first, then the oldest (policy
order); their nodes keep their host K/V (usable as the middle of a longer prefix only). A
host copy is freed with its node's host pages (host eviction, a drop).

With L3 (cache/state_storage.py) every host copy is stored beside its node's pages, and a
write-through node's device snapshot is copied to the host for that as soon as its pages
are (`store_state`); a restored state is filed as a host copy (`adopt_host_state`).

Match ends at the last node with a snapshot on either tier. Where that one is host-only, the
KV manager loads the pages back as for any HiCache hit and then `load_state` gives the node a
fresh device slot and a sync host->device copy of its host snapshot, filed as its device
snapshot; the request's first forward copies it as any hit (copy-on-write). No device slot to
be had (every one pinned): the match is cut back to the last node with a device snapshot
(`resume_at_state`).

A model whose layers are all recurrent (Mamba2, `pages_hold_kv` False) keeps no K/V: its
pages are ids that name tokens, on the host as on the device, and a page op moves no bytes
(the executor reports it done at once). The rules above hold as they are, with one more: a
state eviction of a node with no host copy of its pages gives it one first (write_back's
sync write, `_write_now`), whatever the write policy -- it costs nothing, and the device
state pool, not the pages, is what is short on such a model (its device pages are
rows x context addresses), so without it write_back would rarely keep a snapshot.

Integrity (check_integrity): HiRadixCache's, StateRadixCache's over device snapshots (only on
device-resident nodes), and host state slots: free + cached (one node each, only on a node
with host pages) == total; no host write is ever pending across steps.
"""
from __future__ import annotations

import heapq

from kvstrata.cache.hiradix_cache import HiMatchResult, HiRadixCache
from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.radix_cache import RadixCache, TreeNode
from kvstrata.cache.state_radix import StateRadixCache
from kvstrata.cache.state_slots import StateSlots
from kvstrata.protocol import TransferOp


class StateHiRadixCache(HiRadixCache):
    def __init__(self, allocator: PageAllocator, page_size: int, host_allocator: PageAllocator,
                 slots: PageAllocator, host_slots: PageAllocator,
                 write_policy: str = "write_through", eviction_policy: str = "lru",
                 pages_hold_kv: bool = True):
        self.slots = slots  # the device state pool's slot ids
        self.host_slots = host_slots  # the host state store's slot ids
        self.pages_hold_kv = pages_hold_kv  # False: Mamba2 (module docstring)
        self.total_state_cut_tokens = 0
        self.total_evicted_states = 0
        self.states_to_host = 0  # snapshots written to the host (stats, tests)
        self.states_from_host = 0  # ... and loaded back
        self._loading: TreeNode | None = None  # its host copy is being read this step
        super().__init__(allocator, page_size, host_allocator, write_policy, eviction_policy)
        policy = self._priority
        self._state_priority = policy
        # Device and host eviction: nodes with no snapshot on either tier first.
        self._priority = lambda node: (bool(node.state_slot or node.host_state),) + policy(node)

    def _init_tree(self) -> None:
        super()._init_tree()
        self._num_states = 0
        self._num_pinned = 0
        self._num_host_states = 0

    # StateRadixCache's snapshot bookkeeping as it is (no super() calls in them).
    node_at = StateRadixCache.node_at
    take_state = StateRadixCache.take_state
    pin_state = StateRadixCache.pin_state
    unpin_state = StateRadixCache.unpin_state
    drop_state = StateRadixCache.drop_state
    unpinned_snapshots = StateRadixCache.unpinned_snapshots
    cached_states = StateRadixCache.cached_states
    pinned_states = StateRadixCache.pinned_states

    def attach_state(self, node: TreeNode, slot: int) -> bool:
        assert node is self.root or node.device_pages, f"snapshot on a host-only {node!r}"
        if not StateRadixCache.attach_state(self, node, slot):
            return False
        if self.storage is not None:  # L3: stored now if its node is backed up already
            self.store_state(node)
        return True

    # ------------------------------------------------------------------ match
    def _resumable_pages(self, token_ids: list[int], device_only: bool = False
                         ) -> tuple[int, int]:
        """(pages of the longest cached prefix ending at a node with a snapshot on either
        tier -- device_only: on the device, pages and snapshot --, cached pages); read-only."""
        P = self.page_size
        usable = len(token_ids) - len(token_ids) % P
        node, pos, best, total = self.root, 0, 0, 0
        while pos < usable:
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None or (device_only and not child.device_pages):
                break
            matched = self.matching_pages(child.key, token_ids, pos, usable)
            total += matched
            if matched < len(child.key) // P:
                break  # the match ends inside the node: its snapshot is at its end
            pos += len(child.key)
            node = child
            if child.state_slot or (child.host_state and not device_only):
                best = pos // P
        return best, total

    def resumable_pages(self, token_ids: list[int]) -> int:
        """Whole pages of the longest cached prefix of `token_ids` ending at a snapshot on
        either tier (read-only)."""
        return self._resumable_pages(token_ids)[0]

    def match_prefix(self, token_ids: list[int]) -> HiMatchResult:
        """HiRadixCache.match_prefix cut back to the last node with a snapshot."""
        best, total = self._resumable_pages(token_ids)
        keep = best * self.page_size
        self.total_state_cut_tokens += (total - best) * self.page_size
        match = super().match_prefix(token_ids[:keep])
        self.total_queried_tokens += len(token_ids) - keep  # the cut tail was queried too
        return match

    def peek_device_pages(self, token_ids: list[int]) -> int:
        return self._resumable_pages(token_ids, device_only=True)[0]

    def peek_kv_pages(self, token_ids: list[int]) -> int:
        """Whole pages of `token_ids` whose K/V is on the device, snapshots or not."""
        return RadixCache.peek_device_pages(self, token_ids)

    def match_inserted(self, token_ids: list[int]) -> HiMatchResult:
        """The K/V path (HiRadixCache.match_prefix), with or without a snapshot at its end."""
        return super().match_prefix(token_ids)

    # ------------------------------------------------------------------ host copies
    def alloc_host_state(self) -> int:
        """A free host state slot (dropping an unpinned host snapshot when none is free:
        evict_host_states' order), or 0."""
        if not self.host_slots.available_pages():
            self.evict_host_states(1)
        got = self.host_slots.alloc(1)
        return got[0] if got else 0

    def _write_state(self, node: TreeNode) -> None:
        """Copy the node's device snapshot to a host state slot (sync), unless it has a host
        copy already or no host slot can be had; with L3 the copy is then stored
        (cache/state_storage.py)."""
        if node.host_state or node.host_pages is None:
            return
        slot = self.alloc_host_state()
        if not slot:
            return
        node.host_state = slot
        self._num_host_states += 1
        self.states_to_host += 1
        self.queue_op(TransferOp(self.next_job_id(), "d2h", [], [], sync=True,
                               state_slots=[node.state_slot], host_state_slots=[slot]))
        if self.storage is not None:  # queued after the copy it reads
            self.storage.backup_state(node)

    def store_state(self, node: TreeNode) -> None:
        """L3: the node's pages have a host copy; its device snapshot, if any, goes to a host
        slot and to storage (a host snapshot it has was stored when it was made)."""
        if node.state_slot and node.pending_job is None:
            self._write_state(node)

    def adopt_host_state(self, node: TreeNode, slot: int) -> bool:
        """File host state `slot` (a storage read of the state after `node`'s path) as the
        node's host snapshot. False (the caller keeps the slot) where the node has a snapshot
        on either tier already, or no host copy of its pages to resume with."""
        if node is self.root or node.host_pages is None or node.host_state or node.state_slot:
            return False
        node.host_state = slot
        self._num_host_states += 1
        return True

    def load_state(self, node: TreeNode) -> bool:
        """Give a device node whose snapshot is on the host only a device copy (a fresh slot,
        one sync host->device op). False when it has no host copy or no slot is free even
        after evicting unpinned snapshots. The caller has locked the node."""
        if node is self.root or node.state_slot:
            return True
        if not node.host_state:
            return False
        assert node.device_pages and node.lock_ref, f"load of a state into {node!r}"
        self._loading = node  # evictions below may write other snapshots to the host
        try:
            if not self.slots.available_pages():
                self.evict_states(1)
            got = self.slots.alloc(1)
        finally:
            self._loading = None
        if not got:
            return False
        node.state_slot = got[0]
        self._num_states += 1
        self.states_from_host += 1
        self.queue_op(TransferOp(self.next_job_id(), "h2d", [], [], sync=True,
                               state_slots=got, host_state_slots=[node.host_state]))
        return True

    def free_host_state(self, node: TreeNode) -> None:
        if node.host_state:
            self.host_slots.free([node.host_state])
            node.host_state = 0
            self._num_host_states -= 1

    def _free_host(self, node: TreeNode) -> None:
        self.free_host_state(node)
        super()._free_host(node)

    def _free_device(self, node: TreeNode) -> None:
        """Demotion (host pages kept: the snapshot goes with them) or a drop."""
        if node.state_slot:
            self._write_state(node)
            self.drop_state(node)
        super()._free_device(node)

    # ------------------------------------------------------------------ eviction
    def evict_states(self, num_states: int) -> int:
        """Free at least `num_states` unpinned device snapshots in policy order, each written
        to the host first where its node has host pages; nodes and K/V stay (device eviction
        takes snapshot-less leaves first). Returns how many were freed."""
        if num_states <= 0:
            return 0
        heap = self.unpinned_snapshots()
        freed = 0
        while freed < num_states and heap:
            node = heapq.heappop(heap)[-1]
            if node.pending_job is None:  # (a write in flight: its host pages come later)
                if node.host_pages is None and not self.pages_hold_kv:
                    self._write_now(node)  # pages without K/V: a copy of ids, no bytes
                self._write_state(node)
            self.drop_state(node)
            freed += 1
        self.total_evicted_states += freed
        return freed

    def evict_host_states(self, num_states: int) -> int:
        """Drop the host copies of snapshots (never the one being loaded, nor one a storage
        backup pins): first those whose node still has its device snapshot (a loaded-back
        node, or one L3 copied to store it: nothing is lost), then in policy order."""
        heap = [((not n.state_slot,) + self._state_priority(n), n.id, n) for n in self.nodes()
                if n.host_state and n is not self._loading and not n.host_ref]
        heapq.heapify(heap)
        freed = 0
        while freed < num_states and heap:
            self.free_host_state(heapq.heappop(heap)[-1])
            freed += 1
        return freed

    def cached_host_states(self) -> int:
        return self._num_host_states

    # ------------------------------------------------------------------ admin
    def reset(self) -> bool:
        nodes = list(self.nodes())
        if not super().reset():
            return False
        self.slots.free([n.state_slot for n in nodes if n.state_slot])
        self.host_slots.free([n.host_state for n in nodes if n.host_state])
        return True

    def check_integrity(self) -> None:
        super().check_integrity()
        device, host, pinned = [], [], 0
        for node in self.nodes():
            if node.state_pin:
                assert node.state_slot and node.lock_ref >= node.state_pin, (
                    f"{node!r}: pinned without a snapshot or a lock")
                pinned += node.state_pin
            if node.state_slot:
                assert node.device_pages, f"{node!r}: a device snapshot on a host-only node"
                assert self.slots.is_allocated(node.state_slot), f"{node!r}: free slot"
                device.append(node.state_slot)
            if node.host_state:
                assert node.host_pages is not None, f"{node!r}: host snapshot, no host pages"
                assert self.host_slots.is_allocated(node.host_state), (
                    f"{node!r}: free host state slot {node.host_state}")
                host.append(node.host_state)
        # L3: host snapshots of nodes dropped while a backup pins them (still counted), and
        # prefetches' slots (cache/state_storage.py)
        dropped = self.storage.dropped_host_states() if self.storage is not None else []
        held = self.storage.held_host_states() if self.storage is not None else []
        assert len(set(device)) == len(device), f"a snapshot slot kept twice: {device}"
        every = host + dropped + held
        assert len(set(every)) == len(every), (
            f"a host state slot kept twice: tree {host}, dropped {dropped}, prefetches {held}")
        assert all(self.host_slots.is_allocated(s) for s in dropped + held), (
            f"storage holds a free host state slot: {dropped + held}")
        assert (len(device), pinned, len(host) + len(dropped)) == (
            self._num_states, self._num_pinned, self._num_host_states), (
            f"state counters ({self._num_states}, {self._num_pinned}, "
            f"{self._num_host_states}) != tree ({len(device)}, {pinned}, "
            f"{len(host)} + {len(dropped)} dropped)")
        self.host_slots.check_integrity()
        free = self.host_slots.available_pages()
        assert free + len(every) == self.host_slots.num_pages, (
            f"host state slot leak: free {free} + cached {len(host)} + dropped {len(dropped)} "
            f"+ prefetching {len(held)} != total {self.host_slots.num_pages}")


def resume_at_state(tree: StateHiRadixCache, match: HiMatchResult) -> HiMatchResult:
    """A locked match (its host part loaded back, or not) made to end at a node whose
    snapshot is on the device: its host snapshot is loaded, else the match is cut back to
    the last node with a device snapshot (the lock moved there)."""
    node = match.last_node
    if tree.load_state(node):
        return match
    keep = node
    while keep is not tree.root and not keep.state_slot:
        keep = keep.parent
    pages, n = 0, keep
    while n is not tree.root:
        pages += len(n.key) // tree.page_size
        n = n.parent
    tree.lock(keep)
    tree.unlock(node)
    match.device_pages = match.device_pages[:pages]
    match.last_node = keep
    return match


def state_hicache(plan, allocator: PageAllocator, host_allocator: PageAllocator,
                  write_policy: str, eviction_policy: str, track_interval: int | None):
    """The tree and the request-side StateSlots of a recurrent model with HiCache L2."""
    if not plan.num_host_state_slots:
        raise ValueError("HiCache for a model with recurrent state needs host state slots "
                         "(KVPlan.num_host_state_slots; --hicache-mamba-size-gb)")
    slots = PageAllocator(plan.num_state_slots, 1)
    tree = StateHiRadixCache(allocator, plan.page_size, host_allocator, slots,
                             PageAllocator(plan.num_host_state_slots, 1), write_policy,
                             eviction_policy, pages_hold_kv=plan.pages_hold_kv)
    return tree, StateSlots(slots, tree, plan.page_size, track_interval)
