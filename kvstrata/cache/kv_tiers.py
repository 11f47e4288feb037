"""KVManager's tier half (no torch): what the request-facing facade does with the pools
behind the device pool -- the retraction host pool's backups, a HiCache match's load-back to
the device, the step's tier ops and the runner's events about them, and HiCache L3 prefetch
(cache/storage_tier.py). A mixin: it reads the manager's tree, allocators, SWA pool and
`_matchable`.
"""
from __future__ import annotations

from typing import Any

from kvstrata.cache.invariants import check_backup_pool
from kvstrata.cache.page_keys import salted_ids
from kvstrata.cache.storage_tier import StorageTier
from kvstrata.protocol import StorageCancel, StorageProgress, TransferDone, of_type


def _cache_ids(req: Any) -> list[int]:
    """The request's ids as the prefix cache keys them (salted under its cache salt)."""
    return salted_ids(req.all_ids, req.cache_salt)


class KVTiers:
    @property
    def storage(self) -> StorageTier | None:
        return self.tree.storage if self.hicache else None

    # ------------------------------------------------------------------ retraction backups
    def alloc_backup_pages(self, num_pages: int) -> list[int] | None:
        """Host pages for one retracted request's KV backup, or None when the host pool
        cannot hold it. SGLang first reclaims evictable host pages: with a shared HiCache
        pool, host-only cached pages are evicted for it; a retraction-only pool has no radix
        tree behind it, so every used host page there belongs to a live backup."""
        assert self.backup_pool, "no retraction host pool in the KV plan"
        if self.hicache:
            pages = self.tree.alloc_host(num_pages)
        else:
            pages = self.host_allocator.alloc(num_pages)
        if pages is not None:
            self._backup_pages.update(pages)
        return pages

    def backup_pages(self) -> frozenset[int]:
        """The host pages retraction backups hold now (the backup-pool check compares them
        with what the backups say they hold)."""
        return frozenset(self._backup_pages)

    def free_backup_pages(self, pages: list[int]) -> None:
        self._backup_pages.difference_update(pages)
        self.host_allocator.free(pages)

    def check_backups(self, held: list[list[int]]) -> None:
        """Retraction host pool: free + held by backups == total host pages, none twice."""
        check_backup_pool(self, held)

    def _load_back(self, ids: list[int], match, whole_prompt: bool = False):
        """Bring the host part of a match back to the device: [device part][host part] becomes
        one device prefix. When device memory is short, load what fits (or nothing: the rest
        is recomputed). The device part stays locked throughout."""
        # (with an SWA pool only pages whose host copy has its SWA half take SWA pages)
        swa = self.tree.swa_pages_to_load(match) if self.swa is not None else None
        if not self.ensure_free_pages(len(match.host_pages), swa):
            return self._device_part(ids, match, whole_prompt)
        # Making room may have evicted host copies (write_back) or tombstoned the window's
        # device nodes: match again, still locked.
        again = self.tree.match_prefix(self._matchable(ids, whole_prompt))
        if again.last_node is not match.last_node or not again.host_pages and not (
                self.swa is not None and self.tree.needs_load(again)):
            return self._device_part(ids, match, whole_prompt)
        if self.swa is not None and \
                self.tree.swa_pages_to_load(again) > self.swa.allocator.available_pages():
            return self._device_part(ids, match, whole_prompt)
        device = self.allocator.alloc(len(again.host_pages))
        if device is None:
            return self._device_part(ids, match, whole_prompt)
        node = self.tree.load_back(again, device)
        self.tree.lock(node)
        self.tree.unlock(match.last_node)
        again.device_pages = again.device_pages + device
        again.last_node = node
        return again

    def _device_part(self, ids: list[int], match, whole_prompt: bool):
        """A load-back that did not happen: keep the device part of `match` -- re-matched
        with an SWA pool: its usable end may lie in the host part (the device part's last
        window dead), and room-making may have tombstoned windows since."""
        if self.swa is None:
            return match
        ids = self._matchable(ids, whole_prompt)
        again = self.tree.match_prefix(ids[:self.tree.peek_device_pages(ids) * self.page_size])
        assert not again.host_pages
        self.tree.lock(again.last_node)
        self.tree.unlock(match.last_node)
        return again

    # ------------------------------------------------------------------ tier ops
    def drain_ops(self) -> list:
        """This step's tier ops for the runner: HiCache copies (TransferOp, in order) and
        storage prefetches to stop (StorageCancel)."""
        if not self.hicache:
            return []
        ops, self.tree.pending_ops = self.tree.pending_ops, []
        if self.storage is not None:
            ops += [StorageCancel(job) for job in self.storage.drain_cancels()]
        return ops

    def on_events(self, events: list) -> None:
        """The runner's reports on those ops: device <-> host jobs that ended (TransferDone,
        in order), then storage job progress (StorageProgress)."""
        if not self.hicache:
            return
        for ev in of_type(events, TransferDone):
            self.tree.on_transfer_done(ev.job_id, ev.ok)
        progress = of_type(events, StorageProgress)
        if self.storage is not None and progress:
            self.storage.on_progress(progress)

    def copies_pin_pages(self) -> bool:
        """Async host writes in flight lock their tree nodes until they finish: waiting for
        them frees memory. (Sync ops -- loads, write-back on eviction -- finish within the
        step that carries them and pin nothing afterwards.)"""
        return self.hicache and self.tree.copy_jobs_in_flight() > 0

    def has_transfers_in_flight(self) -> bool:
        return self.hicache and bool(self.tree.pending_ops or self.tree.copy_jobs_in_flight()
                                     or (self.storage is not None and self.storage.busy()))

    # ------------------------------------------------------------------ storage (L3)
    def start_prefetch(self, req: Any) -> bool:
        """On arrival: fetch from storage the whole pages beyond the device+host match."""
        if self.storage is None:
            return False
        return self.storage.start_prefetch(req.rid, self._matchable(_cache_ids(req)))

    def prefetch_ready(self, req: Any) -> bool:
        """May the request be admitted now (its prefetch policy is satisfied)?"""
        return self.storage is None or self.storage.ready(req.rid)

    def abort_prefetch(self, rid: str) -> None:
        if self.storage is not None:
            self.storage.abort(rid)

    def storage_backups_pending(self) -> bool:
        """Host writes whose L3 backup has not ended yet (what a graceful shutdown waits for)."""
        return self.storage is not None and bool(self.tree.copy_jobs_in_flight()
                                                 or self.storage.backups or self.tree.pending_ops)
