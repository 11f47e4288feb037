"""HiCache L3 for a model with recurrent state (no torch): StorageTier over StateHiRadixCache,
whose nodes carry a state snapshot on the device (`state_slot`) and / or the host
(`host_state`) beside their pages (cache/state_hiradix.py).

What is stored: every backed-up page's K/V record as for any uniform pool (the attention
layers' pages, bare keys), and every snapshot that gets a host copy as a "state" record under
the key of the page it ends (page_keys.component_key: "state-<page key>"), in a namespace of
its own (StorageNamespace.for_states: the runner opens a third backend over the host state
slots, runner/executors/hicache.py). A state record is the state after exactly the prefix its
key chains over, so it is valid wherever that key is found, as a page is.

When a snapshot is stored: when it and a host copy of its node's pages both exist, whichever
comes last -- the write policies of the pages decide. write_through: the node's pages are
written to the host at insert, and once that copy is whole (`backup`) a device snapshot of
the node is copied to a host state slot and stored; a snapshot filed later on a node already
backed up (a request finishing there, a chunk end, a track point) is copied and stored at once
(StateHiRadixCache.attach_state). write_through_selective: the same once the node is backed up
(its second hit). write_back: at demotion or state eviction, where L2 writes the snapshot to
the host anyway. A host copy is always made before a state is stored (the backend reads host
slots) and kept afterwards as any host copy: a host state slot costs about what L2 pays, and
with few host slots unpinned copies make room, those whose node still has its device snapshot
first (a backup pins its node: `host_ref`, as the page backups; evict_host_states skips it). A snapshot with
no host slot to be had is not stored (its pages are).

Restoring. A prefetch (the pages past the tree's last snapshot: below) takes a host state slot
beside its host pages, and its "s2h" op names one state key per fetched page. The job finds the
leading stored pages, then reads the furthest stored state among them into that slot and cuts
the fetch there (transfer/storage_jobs.py; StorageProgress.state_page): pages past the last
stored state could never be resumed (a match ends at a snapshot), so they are not read. When
every page up to the state was read, the node ending there -- a new host-only node, or the
tree's own node if it held those pages already and has a host copy -- takes the slot as its
host snapshot (`_insert_host`); the match then ends there and the KV manager loads pages and
snapshot back as for an L2 hit (resume_at_state). A prefetch stopped short, or whose state the
tree cannot adopt, frees the slot; its pages join the tree as host K/V without a snapshot
(usable as the middle of a longer prefix).

The fetch starts where the tree's prefix is resumable -- its last snapshot on either tier --,
not where its K/V ends: a node whose pages stayed but whose snapshot went (state eviction
without a host slot, host snapshot copies dropped under host slot pressure) would else never
get its stored state back (measured: docs/architecture.md "Recurrent state", item 7). The
price: the pages between the two are read again, and only when a stored state lies past them
(the job reads no page past the last stored state); the tree keeps its own copies
(`_insert_host` frees the duplicates) and its node ending at the state adopts it if it has a
host copy of its pages (write_through's nodes do), else the slot is freed. `hit_tokens`
counts those re-read pages too.

Integrity (with StateHiRadixCache.check_integrity): host state slots are free, a node's host
snapshot, a prefetch's slot, or the snapshot of a node dropped from the tree while a backup
read it (freed when that backup ends); backups pin their nodes.
"""
from __future__ import annotations

from kvstrata.cache.page_keys import component_key
from kvstrata.cache.radix_cache import TreeNode
from kvstrata.cache.storage_tier import Backup, Prefetch, StorageTier
from kvstrata.protocol import StorageProgress, TransferOp

def state_key(page_key: str) -> str:
    """The storage key of the snapshot after the page whose chained key is `page_key`."""
    return component_key(page_key, "state")


class StateStorageTier(StorageTier):
    """Owned by StateHiRadixCache (`tree.storage`); see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state_jobs: set[int] = set()  # backups of a host snapshot (not of pages)
        self._claimed = 0  # the host state slot of the prefetch being started

    # ------------------------------------------------------------------ backup
    def backup(self, node: TreeNode) -> None:
        """The node's host page copy is whole: store its pages, and its snapshot with them."""
        super().backup(node)
        self.tree.store_state(node)

    def backup_state(self, node: TreeNode) -> None:
        """Queue an "h2s" job storing the node's host snapshot (its copy is queued before it,
        a sync op) under the key of its last page."""
        job = self.tree.next_job_id()
        node.host_ref += 1
        self.backups[job] = Backup([node])
        self.state_jobs.add(job)
        self.tree.queue_op(TransferOp(job, "h2s", [], [], sync=False,
                                      state_keys=[state_key(self.node_keys(node)[-1])],
                                      host_state_slots=[node.host_state]))

    def _end_backup(self, job: int, p: StorageProgress) -> None:
        if job not in self.state_jobs:
            super()._end_backup(job, p)
            return
        self.state_jobs.discard(job)
        b = self.backups.pop(job)
        self.stats.state_backups += p.done_pages
        self.stats.state_backup_failed += self._short_backup(job, p, "states")
        self._release_backup(b)

    def _release_backup(self, b: Backup) -> None:
        for node in b.nodes:  # dropped while pinned: its host snapshot goes now too
            if node.host_ref == 1 and node.parent is None and node.host_state:
                self.tree.free_host_state(node)
        super()._release_backup(b)

    # ------------------------------------------------------------------ prefetch
    def _cached_pages(self, token_ids: list[int]) -> int:
        """Where the fetch starts: the tree's last snapshot on either tier along `token_ids`,
        not its K/V end (module docstring: the stored states past it are looked for)."""
        return self.tree.resumable_pages(token_ids)

    def _alloc_prefetch(self, n: int) -> list[int] | None:
        slot = self.tree.alloc_host_state()
        if not slot:
            return None  # nothing fetched could be resumed
        host = super()._alloc_prefetch(n)
        if host is None:
            self.tree.host_slots.free([slot])
            return None
        self._claimed = slot
        return host

    def _free_prefetch(self, host_pages: list[int]) -> None:
        super()._free_prefetch(host_pages)
        self.tree.host_slots.free([self._claimed])
        self._claimed = 0

    def _prefetch_op(self, job: int, host_pages: list[int], keys: list[str]) -> TransferOp:
        pf = self.prefetches[job]
        pf.host_state, self._claimed = self._claimed, 0
        return TransferOp(job, "s2h", [], list(host_pages), sync=False, keys=keys,
                          state_keys=[state_key(k) for k in keys],
                          host_state_slots=[pf.host_state])

    def _on_prefetch_progress(self, pf: Prefetch, p: StorageProgress) -> None:
        super()._on_prefetch_progress(pf, p)
        if p.hit_pages >= 0:
            pf.state_page = p.state_page

    def _insert_host(self, pf: Prefetch, keep: int) -> list[int]:
        spare = super()._insert_host(pf, keep)
        if pf.state_page and keep == pf.state_page:  # every page up to the state was read
            end = (pf.start_page + keep) * self.page_size
            node = self.tree.node_at(pf.token_ids[:end])
            if node is not None and self.tree.adopt_host_state(node, pf.host_state):
                pf.host_state = 0
                self.stats.state_hits += 1
        return spare

    def _close(self, pf: Prefetch, keep: int) -> None:
        super()._close(pf, keep)
        if pf.host_state:  # not adopted
            self.tree.host_slots.free([pf.host_state])
            pf.host_state = 0

    # ------------------------------------------------------------------ checks
    def held_host_states(self) -> list[int]:
        """Host state slots prefetches hold (outside the tree)."""
        return [pf.host_state for pf in self.prefetches.values() if pf.host_state]

    def dropped_host_states(self) -> list[int]:
        """Host snapshots of nodes dropped from the tree while a backup pins them."""
        seen: dict[int, int] = {}
        for b in self.backups.values():
            for node in b.nodes:
                if node.parent is None and node.host_state:
                    seen[node.id] = node.host_state
        return list(seen.values())

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self.state_jobs <= set(self.backups), "a state backup's record is lost"
        assert not self._claimed, "a prefetch's host state slot was claimed and not used"
