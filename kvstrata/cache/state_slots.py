"""Recurrent-state slots, the request side (no torch): which state pool slot each request
computes in, and what the runner does with slots around a forward (ScheduledRequest's
state_slot / state_reset / state_copy_from / state_snapshot_to).

Slots 1..N of the plan's state pool (slot 0: the padding sink) are each exactly one of:
  free                        the allocator's
  a request's working slot    `state_slot`: allocated at admission, holds the state after
                              positions [0, num_computed_tokens); chunked prefill carries it
                              from chunk to chunk; freed at finish / abort / retraction (or
                              donated to the prefix cache at a finish)
  a request's aside slot      `state_aside_slot`: a snapshot it took at position
                              `state_aside_pos` (page-aligned) for the prefix cache -- at a
                              prefill chunk's end (filed at once, cache_unfinished) or at an
                              extra_buffer track point, a decode step's end or the last one
                              inside its prompt's last chunk (state_snapshot_at: the runner
                              takes it mid-forward), kept until the request ends
  a cached snapshot           owned by a tree node (cache/state_radix.py)
(free + held by requests + cached == total: `check`). A request holds at most two.

A request's first forward after admission starts from a clean state (`state_reset`: no
usable prefix, also a recompute after retraction) or from the matched node's snapshot
(`state_copy_from`, pinned from the match until that forward ran: copy-on-write). At its end
its state after positions [0, L) (L = num_computed_tokens: prompt + output[:-1]) is donated
where L is page-aligned -- what the K/V of the tree covers --, else its last tracked snapshot
if it has one (the K/V is then cached up to that position only: the rest could never be
resumed). Snapshots are best effort: when no slot is free even after evicting cached
snapshots, a chunk end or track point is skipped. A working slot is not: admission waits.

Per-request fields (duck-typed, like the rest of the request's KV state): state_slot,
state_fresh (reset at its next forward), state_copy_node (the pinned node to copy from at its
next forward), state_aside_slot, state_aside_pos.
"""
from __future__ import annotations

from typing import Any

from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.state_radix import StateRadixCache


class StateSlots:
    def __init__(self, allocator: PageAllocator, tree: StateRadixCache, page_size: int,
                 track_interval: int | None):
        """`track_interval`: extra_buffer's track cadence (a multiple of the page size), None
        for no_buffer (no track points: a finish is always page-aligned at page size 1)."""
        assert track_interval is None or track_interval % page_size == 0, track_interval
        self.allocator = allocator
        self.tree = tree
        self.page_size = page_size
        self.track_interval = track_interval
        self._copying: list[Any] = []  # nodes pinned for this step's copies
        self.snapshots_taken = 0  # state_snapshot_to emitted (stats, tests)
        self.snapshots_skipped = 0  # chunk ends / track points without a free slot

    @property
    def num_slots(self) -> int:
        return self.allocator.num_pages

    def alloc(self) -> int:
        """A free slot (evicting one cached snapshot when none is free), or 0."""
        if not self.allocator.available_pages():
            self.tree.evict_states(1)
        got = self.allocator.alloc(1)
        return got[0] if got else 0

    def free(self, slot: int) -> None:
        if slot:
            self.allocator.free([slot])

    # ------------------------------------------------------------------ admission
    def on_match(self, req: Any, node: Any, kv_end: int) -> None:
        """A request matched `node` (the root: nothing): its first forward copies the node's
        snapshot, pinned until then, or starts clean. `kv_end`: where the cached K/V of its
        prompt ends; past the snapshot, that is a branch point inside a node (a state
        tombstone, other requests' paths running on), and its prefill ends a chunk there to
        snapshot it, so that the next request of that prefix resumes there (SGLang's
        extra_buffer tracks mamba_branching_seqlen for the same reason)."""
        req.state_branch_end = kv_end if kv_end > req.num_computed_tokens else 0
        if node is not self.tree.root:
            self.tree.pin_state(node)
            req.state_copy_node = node
        else:
            req.state_fresh = True

    def assign(self, req: Any) -> bool:
        """The request's working slot; False when the pool has none (admission waits). When
        the only slot left is the snapshot the request resumes from (no other request copies
        it), the request takes that slot over instead (it holds exactly the state it needs;
        the node becomes a tombstone): a pool that small could never serve the hit else,
        and with nothing running admission would stall."""
        assert not req.state_slot, f"{req.rid} already holds state slot {req.state_slot}"
        req.state_slot = self.alloc()
        node = req.state_copy_node
        if not req.state_slot and node is not None and node.state_pin == 1:
            req.state_slot = self.tree.take_state(node)
            req.state_copy_node = None
        return bool(req.state_slot)

    # ------------------------------------------------------------------ one forward
    def entry_fields(self, req: Any, end: int, chunk_end: bool, num_draft: int = 0) -> dict:
        """ScheduledRequest's state fields for a forward of the request up to position `end`;
        `chunk_end`: a prefill chunk that is not the prompt's last; `num_draft`: a
        speculative verify's drafts (its state lands where acceptance says, not at `end`:
        no track point is snapshotted on it)."""
        assert req.state_slot, f"{req.rid} is scheduled without a state slot"
        fields: dict = {"state_slot": req.state_slot}
        node = req.state_copy_node
        if node is not None:
            fields["state_copy_from"] = node.state_slot
            self._copying.append(node)
            req.state_copy_node = None
        elif req.state_fresh:
            fields["state_reset"] = True
        req.state_fresh = False
        at = self._snapshot_point(req, end, chunk_end, num_draft)
        if not at:
            return fields
        slot = req.state_aside_slot or self.alloc()
        if not slot:
            self.snapshots_skipped += 1
            return fields
        req.state_aside_slot, req.state_aside_pos = slot, at
        fields["state_snapshot_to"] = slot
        if at != end:
            fields["state_snapshot_at"] = at
        self.snapshots_taken += 1
        return fields

    def _snapshot_point(self, req: Any, end: int, chunk_end: bool, num_draft: int) -> int:
        """Where this forward (from req.num_computed_tokens to `end`) snapshots its state, 0
        for nowhere: a prefill chunk's end, a track point it ends on, or (extra_buffer) the
        last track point inside the prompt's last chunk -- SGLang's extra_buffer tracks the
        state inside an extend too, so a prompt whose end is not page-aligned still leaves
        a snapshot at its last page end for the next turn (without it an unchunked prompt
        left none unless its decode crossed a page end)."""
        if self.tree.disable or num_draft:
            return 0
        every = self.track_interval
        if end % self.page_size == 0 and (chunk_end or (every and end % every == 0)):
            return end
        if every and not chunk_end:
            inside = end // every * every
            if req.num_computed_tokens < inside and inside > req.state_aside_pos:
                return inside
        return 0

    def after_forward(self) -> None:
        """The step's copies are made: the snapshots they read may go."""
        for node in self._copying:
            self.tree.unpin_state(node)
        self._copying = []

    def after_chunk(self, req: Any, node: Any, end: int) -> None:
        """A prefill chunk's K/V up to `end` is cached, `node` ending there: file the
        snapshot the chunk took (a duplicate of one the node has is freed)."""
        if req.state_aside_slot and req.state_aside_pos == end:
            if not self.tree.attach_state(node, req.state_aside_slot):
                self.free(req.state_aside_slot)
            req.state_aside_slot = req.state_aside_pos = 0

    # ------------------------------------------------------------------ the end
    def donation(self, req: Any) -> tuple[int, int]:
        """(position, slot) of the snapshot a finishing request leaves the prefix cache, or
        (0, 0): its working state where its computed end is page-aligned, else its last
        tracked one (module docstring)."""
        end = req.num_computed_tokens
        if self.tree.disable or not req.state_slot or req.state_copy_node is not None \
                or req.state_fresh:
            return 0, 0  # (a request whose first forward never ran holds no state yet)
        if end and end % self.page_size == 0 and not req.state_past_end:
            return end, req.state_slot
        if req.state_aside_slot and req.state_aside_pos <= end:
            return req.state_aside_pos, req.state_aside_slot
        return 0, 0

    def release(self, req: Any, key: list[int] | None = None, pos: int = 0,
                slot: int = 0) -> None:
        """Drop the request's slots; `slot` (its donation at `pos`, the tree holding the K/V
        of key[:pos]) goes to the node ending there, unless that one has a snapshot."""
        if req.state_copy_node is not None:  # admission refused before its forward
            self.tree.unpin_state(req.state_copy_node)
        filed = 0
        if slot:
            node = self.tree.node_at(key[:pos])
            assert node is not None, f"{req.rid}: no cached node ends at its snapshot ({pos})"
            filed = slot if self.tree.attach_state(node, slot) else 0
        for own in (req.state_slot, req.state_aside_slot):
            if own and own != filed:
                self.free(own)
        req.state_slot = req.state_aside_slot = req.state_aside_pos = 0
        req.state_copy_node = None
        req.state_fresh = False
        req.state_branch_end = 0
        req.state_past_end = False

    # ------------------------------------------------------------------ checks
    def held(self, req: Any) -> list[int]:
        return [s for s in (req.state_slot, req.state_aside_slot) if s]

    def check(self, live_requests: list[Any]) -> None:
        """free + held by live requests + cached in the tree == total, each slot once."""
        alloc = self.allocator
        alloc.check_integrity()
        owned = [slot for req in live_requests for slot in self.held(req)]
        for req in live_requests:
            assert req.state_slot or not req.state_aside_slot, (
                f"{req.rid}: an aside slot without a working slot")
            assert req.state_aside_pos <= req.num_computed_tokens, (
                f"{req.rid}: aside snapshot at {req.state_aside_pos} past its computed "
                f"{req.num_computed_tokens}")
        tree = [n.state_slot for n in self.tree.nodes() if n.state_slot]
        assert len(set(owned + tree)) == len(owned) + len(tree), (
            f"a state slot held twice: requests {owned}, tree {tree}")
        assert all(alloc.is_allocated(s) for s in owned), "a request holds a free state slot"
        assert not self._copying, "snapshot pins left after a forward"
        free = alloc.available_pages()
        assert free + len(owned) + len(tree) == alloc.num_pages, (
            f"state slot leak: free {free} + held by requests {len(owned)} + cached "
            f"{len(tree)} != total {alloc.num_pages}")
