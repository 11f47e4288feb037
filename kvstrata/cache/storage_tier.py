"""HiCache L3 bookkeeping (no torch): what goes to storage and what comes back, decided next
to the radix tree; the runner's storage job runner (transfer/storage_jobs.py) moves the
bytes and reports StorageProgress.

Backup (L2 -> L3): when a node's device->host write completes, its host pages are written to
storage by an "h2s" job. The node's host copy is pinned (`host_ref`) until the job's final
progress: host eviction skips it, and if a device eviction drops the node meanwhile its host
pages are freed only then. A failed or short backup is counted and logged, never taken for
success (nothing in the tree says "stored": storage presence is always asked of the backend).

Prefetch (L3 -> L2), on request arrival: the whole pages beyond the device+host match, if at
least `threshold` tokens, get host pages up front and an "s2h" job. Per request:

    host_pages: [ read (done) | found, not yet read | not found (freed once hit is known) ]
                0 ......... done_pages ......... hit_pages ..................... len

The request may be admitted once its prefetch is terminable (policy): best_effort at once,
wait_complete when done == hit, timeout when done == hit or the timeout passed. A running
job is cancelled first and finished when its final progress arrives; then the first
done_pages pages join the tree as host-only nodes (pages the tree meanwhile got are
duplicates and freed) and are loaded back like any host hit. An aborted request's prefetch
is cancelled and its host pages are freed when the final progress arrives.

The policy's configuration and the job records: cache/storage_records.py.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from kvstrata.cache.page_keys import chain_page_keys
from kvstrata.cache.radix_cache import TreeNode
from kvstrata.cache.storage_records import (  # noqa: F401 (re-exported)
    PREFETCH_CAPACITY_SHARE, PREFETCH_DEFAULTS, PREFETCH_POLICIES, Backup, Prefetch,
    PrefetchConfig, StorageStats)
from kvstrata.protocol import StorageProgress, TransferOp

logger = logging.getLogger(__name__)


class StorageTier:
    """Owned by HiRadixCache (`tree.storage`); see the module docstring."""

    def __init__(self, tree, config: PrefetchConfig, prefetch_capacity_pages: int,
                 clock: Callable[[], float] = time.monotonic):
        self.tree = tree
        self.config = config
        self.page_size = tree.page_size
        # Effective threshold: at least one page (a shorter fetch has nothing to read).
        self.threshold_pages = max(-(-config.threshold_tokens // self.page_size), 1)
        self.capacity_pages = prefetch_capacity_pages
        self.clock = clock
        self.backups: dict[int, Backup] = {}
        self.prefetches: dict[int, Prefetch] = {}   # job id -> state
        self.by_rid: dict[str, int] = {}            # waiting request -> its prefetch job
        self.cancels: list[int] = []
        self.occupied_pages = 0
        self.stats = StorageStats()

    # ------------------------------------------------------------------ keys
    def node_keys(self, node: TreeNode) -> list[str]:
        """Storage keys of `node`'s pages, chained from its parent's last key (cached)."""
        path = []
        while node is not self.tree.root and node.hash_keys is None:
            path.append(node)
            node = node.parent
        prior = node.hash_keys[-1] if node is not self.tree.root else None
        for n in reversed(path):
            n.hash_keys = chain_page_keys(n.key, self.page_size, prior)
            prior = n.hash_keys[-1]
        return (path[0] if path else node).hash_keys

    # ------------------------------------------------------------------ backup
    def backup(self, node: TreeNode) -> None:
        """Queue an "h2s" job for a node whose host copy just became complete."""
        if not node.host_pages:
            return
        job = self.tree.next_job_id()
        node.host_ref += 1
        self.backups[job] = Backup([node])
        self.tree.queue_op(self._backup_op(job, node))

    # Hooks a tree with a second device pool extends (cache/swa_storage.py): the ops' keys,
    # and the host-only nodes a finished prefetch hangs under the tree.
    def _backup_op(self, job: int, node: TreeNode) -> TransferOp:
        return TransferOp(job, "h2s", [], list(node.host_pages), sync=False,
                          keys=list(self.node_keys(node)))

    def _prefetch_op(self, job: int, host_pages: list[int], keys: list[str]) -> TransferOp:
        return TransferOp(job, "s2h", [], list(host_pages), sync=False, keys=keys)

    def _new_host_nodes(self, parent: TreeNode, pf: "Prefetch", first: int, end: int,
                        pages: list[int], keys: list[str], now: int) -> None:
        """Pages [first, end) of pf's prefix (host `pages`, storage `keys`) as one host-only
        leaf under `parent`."""
        P = self.page_size
        leaf = TreeNode(tuple(pf.token_ids[first * P:end * P]), [], parent, now)
        leaf.host_pages, leaf.hash_keys = pages, keys
        parent.children[leaf.key[:P]] = leaf

    def _alloc_prefetch(self, n: int) -> list[int] | None:
        """Host room for a prefetch of `n` pages (a tree with host state slots takes one of
        those too), or None."""
        return self.tree.alloc_host(n)

    def _free_prefetch(self, host_pages: list[int]) -> None:
        """Give back what `_alloc_prefetch` took, for a prefetch not started."""
        self.tree.host_allocator.free(host_pages)

    def _lead_pages(self, token_ids: list[int], start: int, n: int) -> int:
        """Pages before the tree's end (`start`) to fetch too: none here (a second device
        pool's tier heals the window before that end with them)."""
        return 0

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        for b in self.backups.values():
            if lower in b.nodes:
                b.nodes.append(upper)

    def _end_backup(self, job: int, p: StorageProgress) -> None:
        b = self.backups.pop(job)
        self.stats.backup_pages += p.done_pages
        self.stats.backup_failed_pages += self._short_backup(job, p, "pages")
        self._release_backup(b)

    def _short_backup(self, job: int, p: StorageProgress, what: str) -> int:
        """How many of its pages (states) a finished backup did not store: logged, and a
        backend failure counted as an error."""
        if not (p.error or p.done_pages < p.hit_pages):
            return 0
        self.stats.errors += bool(p.error)
        logger.warning("HiCache storage backup job %d stored %d of %d %s%s", job,
                       p.done_pages, p.hit_pages, what, f": {p.error}" if p.error else "")
        return p.hit_pages - p.done_pages

    def _release_backup(self, b: Backup) -> None:
        """A backup ended: its pins go; a node dropped from the tree while the backup read
        it has its host copy freed now."""
        for node in b.nodes:
            node.host_ref -= 1
            if node.host_ref == 0 and node.parent is None and node.host_pages:
                self.tree.host_allocator.free(node.host_pages)
                node.host_pages = None

    # ------------------------------------------------------------------ prefetch
    def _cached_pages(self, token_ids: list[int]) -> int:
        """Whole pages of `token_ids` in the tree on either tier, read-only."""
        tree, P = self.tree, self.page_size
        node, pos, pages = tree.root, 0, 0
        while pos < len(token_ids):
            child = node.children.get(tree.page_key(token_ids, pos))
            if child is None:
                break
            matched = tree.matching_pages(child.key, token_ids, pos, len(token_ids))
            pages += matched
            if matched < len(child.key) // P:
                break
            pos += matched * P
            node = child
        return pages

    def start_prefetch(self, rid: str, token_ids: list[int]) -> bool:
        """`token_ids`: the request's matchable whole pages. True when a job was queued."""
        P = self.page_size
        usable = len(token_ids) // P
        start = self._cached_pages(token_ids[:usable * P])
        n = usable - start
        if rid in self.by_rid:
            return False
        lead = self._lead_pages(token_ids[:usable * P], start, n)
        if n + (start if lead else 0) < self.threshold_pages:  # (a lead heals the tree's end)
            return False
        n += lead
        if self.occupied_pages and self.occupied_pages + n > self.capacity_pages:
            return False  # rate limit; an idle limiter still lets one request through
        host = self._alloc_prefetch(n)
        if host is None:
            return False
        if self._cached_pages(token_ids[:usable * P]) < start:
            # Making room evicted the request's own host prefix: the fetched pages would
            # have nothing to hang under. Recompute instead.
            self._free_prefetch(host)
            return False
        start -= lead
        keys = chain_page_keys(token_ids[:usable * P], P)[start:]
        job = self.tree.next_job_id()
        self.prefetches[job] = Prefetch(job, rid, list(token_ids[:usable * P]), start, host,
                                        self.clock(), lead_pages=lead)
        self.by_rid[rid] = job
        self.occupied_pages += n
        self.tree.queue_op(self._prefetch_op(job, host, keys))
        return True

    def _cancel(self, pf: Prefetch) -> None:
        if not pf.finished and not pf.cancel_sent:
            pf.cancel_sent = True
            self.cancels.append(pf.job_id)

    def _on_prefetch_progress(self, pf: Prefetch, p: StorageProgress) -> None:
        if p.hit_pages >= 0 and pf.hit_pages < 0:
            pf.hit_pages = p.hit_pages
            # Pages not found are never written: free them now (capacity for others).
            tail = pf.host_pages[p.hit_pages:]
            if tail:
                self.tree.host_allocator.free(tail)
                del pf.host_pages[p.hit_pages:]
                self.occupied_pages -= len(tail)
            if p.hit_pages < self.threshold_pages:
                pf.revoked = True
                self._cancel(pf)
        pf.done_pages = max(pf.done_pages, p.done_pages)
        if p.error:
            self.stats.errors += 1
            logger.warning("HiCache storage prefetch job %d for %s: %s", pf.job_id, pf.rid,
                           p.error)
        if p.finished:
            pf.finished = True
            if pf.aborted:
                self._close(pf, keep=0)

    def ready(self, rid: str) -> bool:
        """May `rid` be scheduled now? Finishes a terminated prefetch (its pages join the
        tree); asks to cancel one that the policy lets go but that is still running."""
        job = self.by_rid.get(rid)
        if job is None:
            return True
        pf = self.prefetches[job]
        if pf.finished:
            self._close(pf, keep=0 if pf.revoked else pf.done_pages)
            return True
        if self._terminable(pf):
            self._cancel(pf)
        return False

    def _terminable(self, pf: Prefetch) -> bool:
        if pf.revoked or self.config.policy == "best_effort":
            return True
        complete = pf.hit_pages >= 0 and pf.done_pages >= pf.hit_pages
        if complete or self.config.policy == "wait_complete":
            return complete
        pages = pf.hit_pages if pf.hit_pages >= 0 else len(pf.host_pages)
        timeout = self.config.timeout_seconds(pages * self.page_size)
        return self.clock() - pf.started_at >= timeout

    def abort(self, rid: str) -> None:
        """The request left the queue without being scheduled: drop its prefetch."""
        job = self.by_rid.pop(rid, None)
        if job is None:
            return
        pf = self.prefetches[job]
        pf.aborted = True
        if pf.finished:
            self._close(pf, keep=0)
        else:
            self._cancel(pf)

    def _close(self, pf: Prefetch, keep: int) -> None:
        """End of a prefetch: the first `keep` pages join the tree, every other page is freed."""
        del self.prefetches[pf.job_id]
        if self.by_rid.get(pf.rid) == pf.job_id:
            del self.by_rid[pf.rid]
        self.occupied_pages -= len(pf.host_pages)
        free = pf.host_pages[keep:]
        if keep:
            free += self._insert_host(pf, keep)
        if free:
            self.tree.host_allocator.free(free)
        s, P = self.stats, self.page_size
        hit = max(pf.hit_pages, 0)
        s.hit_tokens += keep * P
        s.miss_tokens += (len(pf.token_ids) // P - pf.start_page - hit) * P
        if pf.aborted:
            s.prefetch_cancelled += 1
        elif pf.revoked:
            s.prefetch_revoked += 1
        elif keep == hit:
            s.prefetch_complete += 1
        else:
            s.prefetch_partial += 1

    def _insert_host(self, pf: Prefetch, keep: int) -> list[int]:
        """Hang pages [start, start + keep) of pf under the tree path of its prefix as
        host-only nodes; returns the host pages the tree did not adopt (duplicates, or all
        of them if the prefix path was evicted meanwhile)."""
        tree, P = self.tree, self.page_size
        ids, start, end = pf.token_ids, pf.start_page, pf.start_page + keep
        pages, keys = pf.host_pages[:keep], None
        now = tree.tick()
        node, page = tree.root, 0
        while page < end:
            child = node.children.get(tree.page_key(ids, page * P))
            if child is None:
                if page < start:
                    return pages  # the prefix is gone: nothing to hang the pages under
                if keys is None:
                    keys = chain_page_keys(ids[:end * P], P)
                self._new_host_nodes(node, pf, page, end, pages[page - start:],
                                     keys[page:end], now)
                return pages[:page - start]
            matched = tree.matching_pages(child.key, ids, page * P, end * P)
            if matched < len(child.key) // P and page + matched < end:
                child = tree.split_node(child, matched)
            child.last_access_time = now
            page += matched
            node = child
        return pages  # the tree already had every page

    # ------------------------------------------------------------------ progress and checks
    def on_progress(self, progress: list[StorageProgress]) -> None:
        for p in progress:
            if p.job_id in self.backups:
                if p.finished:
                    self._end_backup(p.job_id, p)
            elif p.job_id in self.prefetches:
                self._on_prefetch_progress(self.prefetches[p.job_id], p)

    def drain_cancels(self) -> list[int]:
        out, self.cancels = self.cancels, []
        return out

    def busy(self) -> bool:
        return bool(self.backups or self.prefetches)

    def held_host_pages(self) -> list[int]:
        """Host pages the storage side holds outside the tree: prefetch buffers, and the host
        copies of nodes dropped while a backup still reads them."""
        held = [p for pf in self.prefetches.values() for p in pf.host_pages]
        seen: set[int] = set()
        for b in self.backups.values():
            for node in b.nodes:
                if node.parent is None and node.host_pages and node.id not in seen:
                    seen.add(node.id)
                    held += node.host_pages
        return held

    def check_integrity(self) -> None:
        pins: dict[int, int] = {}
        for b in self.backups.values():
            for node in b.nodes:
                pins[node.id] = pins.get(node.id, 0) + 1
        for node in self.tree.nodes():
            assert node.host_ref == pins.get(node.id, 0), (
                f"{node!r}: host_ref {node.host_ref} but {pins.get(node.id, 0)} backups read it")
        assert self.occupied_pages == sum(len(pf.host_pages) for pf in self.prefetches.values())
        assert set(self.by_rid.values()) <= set(self.prefetches), "a request's prefetch is lost"
