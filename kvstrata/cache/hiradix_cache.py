"""Radix cache whose nodes may also live in the host pool (HiCache L2), no torch.

Residency of a node (page size P, n = len(key) / P pages):

    device-only   device_pages = n ids, host_pages None
    device+host   device_pages = n ids, host_pages = n ids ("backed up")
    host-only     device_pages = [],    host_pages = n ids ("evicted but backed up")

Invariant: device residency is prefix-closed (a device node's ancestors are device nodes),
because the device evictor only takes nodes with no device-resident child.

Writes device->host are asynchronous jobs: the node keeps a `pending_job` and is locked until
the runner reports the job id (then `pending_host` becomes `host_pages`). Write policies:
write_through backs a node up when it is inserted; write_through_selective once it has been
matched twice; write_back only when the device evicts it (a *sync* write that completes
before the forward that might reuse those device pages). Loads host->device are sync too.
The ops accumulate in `pending_ops`; the KV manager hands them to the runner each step.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.radix_cache import MatchResult, RadixCache, TreeNode
from kvstrata.protocol import TransferOp

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_HIT_THRESHOLD = 2


@dataclass
class HiMatchResult(MatchResult):
    host_pages: list[int] = field(default_factory=list)  # host part, after the device part
    last_host_node: TreeNode | None = None


@dataclass
class HiCacheStats:
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0  # loaded back instead of recomputed
    d2h_pages: int = 0
    h2d_pages: int = 0
    demoted_pages: int = 0
    failed_jobs: int = 0


class HiRadixCache(RadixCache):
    def __init__(self, allocator: PageAllocator, page_size: int, host_allocator: PageAllocator,
                 write_policy: str = "write_through", eviction_policy: str = "lru"):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {WRITE_POLICIES}, "
                             f"got {write_policy!r}")
        super().__init__(allocator, page_size, disable=False, eviction_policy=eviction_policy)
        self.host_allocator = host_allocator
        # Host pages the pool lends outside the tree (a decode server's retraction backups
        # sharing this pool: cache/kv_manager.py); counted as used by check_integrity.
        self.held_elsewhere = lambda: ()
        self.write_policy = write_policy
        self.pending_ops: list[TransferOp] = []
        self._job_ids = itertools.count(1)
        self._jobs: dict[int, tuple[TreeNode, list[TreeNode]]] = {}  # id -> (locked, covered)
        self.stats = HiCacheStats()
        self.storage = None  # StorageTier (cache/storage_tier.py) with --hicache-storage-backend

    def next_job_id(self) -> int:
        return next(self._job_ids)

    # ------------------------------------------------------------------ match
    def match_prefix(self, token_ids: list[int]) -> HiMatchResult:
        self.total_queried_tokens += len(token_ids)
        P = self.page_size
        usable = len(token_ids) - len(token_ids) % P
        now = self.tick()
        node = self.root
        device: list[int] = []
        host: list[int] = []
        last_device, last_host = self.root, None
        pos = 0
        while pos < usable:
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None:
                break
            matched = self.matching_pages(child.key, token_ids, pos, usable)
            if matched < len(child.key) // P:
                child = self.split_node(child, matched)
            child.last_access_time = now
            child.hit_count += 1
            if child.device_pages:
                assert not host, "device residency must be prefix-closed"
                device.extend(child.device_pages)
                last_device = child
                if (self.write_policy == "write_through_selective"
                        and child.hit_count >= SELECTIVE_HIT_THRESHOLD):
                    self._backup(child)
            else:
                host.extend(child.host_pages)
                last_host = child
            pos += matched * P
            node = child
        self.total_matched_tokens += len(device) * P
        return HiMatchResult(device, last_device, host, last_host)

    def load_back(self, match: HiMatchResult, device_pages: list[int]) -> TreeNode:
        """Give the host-only nodes of `match` the (already allocated) device pages and queue
        one sync host->device op. Returns the new deepest device node (lock it)."""
        assert len(device_pages) == len(match.host_pages)
        path = []
        node = match.last_host_node
        while node is not None and not node.device_pages and node is not self.root:
            path.append(node)
            node = node.parent
        path.reverse()
        offset = 0
        for n in path:
            k = len(n.key) // self.page_size
            self._adopt_loaded(n, device_pages[offset:offset + k])
            offset += k
        self.queue_op(self._copy_op(next(self._job_ids), "h2d", list(device_pages),
                                  list(match.host_pages), sync=True))
        self.stats.h2d_pages += len(device_pages)
        self.stats.host_hit_tokens += len(device_pages) * self.page_size
        return match.last_host_node

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: list[int], pages: list[int]) -> int:
        """As RadixCache.insert. Host-only nodes on the path adopt the caller's pages (they
        become device+host), so only the leading device-resident part is duplicate."""
        P = self.page_size
        if len(token_ids) != len(pages) * P:
            raise ValueError(f"insert needs whole pages: {len(token_ids)} tokens != "
                             f"{len(pages)} pages * {P}")
        now = self.tick()
        node, pos, device_known = self.root, 0, 0
        while pos < len(token_ids):
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None:
                leaf = TreeNode(tuple(token_ids[pos:]), list(pages[pos // P:]), node, now)
                node.children[leaf.key[:P]] = leaf
                self._evictable_pages += leaf.num_pages
                if self.write_policy == "write_through":
                    self._backup(leaf)
                break
            matched = self.matching_pages(child.key, token_ids, pos, len(token_ids))
            if matched < len(child.key) // P and (pos + matched * P < len(token_ids)
                                                   or not child.device_pages):
                child = self.split_node(child, matched)
            child.last_access_time = now
            if child.device_pages:
                device_known = pos // P + matched
            else:
                child.device_pages = list(pages[pos // P:pos // P + matched])
                self._evictable_pages += matched
            pos += matched * P
            node = child
        return device_known

    # ------------------------------------------------------------------ host copies
    def queue_op(self, op: TransferOp) -> None:
        """Queue a transfer op for the next SchedulerOutput (the storage tier queues its
        backup and prefetch jobs here too)."""
        self.pending_ops.append(op)

    def copy_jobs_in_flight(self) -> int:
        """Device<->host copy jobs queued and not yet reported done; each holds a lock on
        its nodes until then."""
        return len(self._jobs)

    def copy_job_locks(self) -> list[TreeNode]:
        """The node each in-flight copy job locked (the KV-state check counts these as lock
        holders beside the requests)."""
        return [locked for locked, _ in self._jobs.values()]

    # Hooks a tree with a second device pool extends (cache/swa_hiradix.py): a loaded node
    # taking its device pages, the op copying pages, a node's device pages going.
    def _adopt_loaded(self, node: TreeNode, device_pages: list[int]) -> None:
        node.device_pages = device_pages
        self._evictable_pages += len(device_pages)  # unlocked until the caller locks it

    def _copy_op(self, job: int, kind: str, device_pages: list[int], host_pages: list[int],
                 sync: bool, node: TreeNode | None = None) -> TransferOp:
        return TransferOp(job, kind, device_pages, host_pages, sync=sync)

    def _free_device(self, node: TreeNode) -> None:
        self.allocator.free(node.device_pages)

    def _free_host(self, node: TreeNode) -> None:
        """A node's host copy goes (host eviction, or a host-only node dropped with its
        device ancestor)."""
        self.host_allocator.free(node.host_pages)

    def alloc_host(self, n: int) -> list[int] | None:
        """`n` host pages, evicting host-only cached pages first if the pool is short (tree
        write-backs, storage prefetches, a decode server's retraction backups); None if
        even that does not free enough."""
        short = n - self.host_allocator.available_pages()
        if short > 0:
            self.evict_host(short)
        return self.host_allocator.alloc(n)

    def _backup(self, node: TreeNode) -> None:
        """Start an async device->host write of `node` unless it has (or is getting) a copy.
        No host room -> no backup (the node is simply dropped on device eviction)."""
        if node.host_pages is not None or node.pending_job is not None or not node.device_pages:
            return
        host = self.alloc_host(node.num_pages)
        if host is None:
            return
        job = next(self._job_ids)
        node.pending_job, node.pending_host = job, host
        self.lock(node)  # the source pages must not be evicted or reused while copying
        self._jobs[job] = (node, [node])
        self.queue_op(self._copy_op(job, "d2h", list(node.device_pages), list(host), sync=False,
                                  node=node))
        self.stats.d2h_pages += node.num_pages

    def _write_now(self, node: TreeNode) -> bool:
        """write_back's write: a sync device->host copy of `node`'s pages (run before the
        forward that may reuse them), stored too with L3. False when no host room."""
        host = self.alloc_host(node.num_pages)
        if host is None:
            return False
        self.queue_op(self._copy_op(next(self._job_ids), "d2h", list(node.device_pages),
                                    list(host), sync=True, node=node))
        node.host_pages = host
        self.stats.d2h_pages += node.num_pages
        if self.storage is not None:  # queued after the sync write it reads
            self.storage.backup(node)
        return True

    def _on_split_pending(self, upper: TreeNode, lower: TreeNode) -> None:
        locked, covered = self._jobs[lower.pending_job]
        covered.append(upper)

    def _on_split_host_ref(self, upper: TreeNode, lower: TreeNode) -> None:
        self.storage.on_split(upper, lower)

    def on_transfer_done(self, job_id: int, ok: bool) -> None:
        """Called with every job id the runner reports (sync ones included)."""
        entry = self._jobs.pop(job_id, None)
        if entry is None:
            if not ok:
                self.stats.failed_jobs += 1
            return  # a load or write-back: nothing waits on it here
        locked, covered = entry
        for node in covered:
            if ok:
                node.host_pages = node.pending_host
            else:
                self.host_allocator.free(node.pending_host)
            node.pending_job = node.pending_host = None
            if ok and self.storage is not None:
                self.storage.backup(node)  # L2 -> L3 once the host copy is whole
        if not ok:
            self.stats.failed_jobs += 1
        self.unlock(locked)

    # ------------------------------------------------------------------ eviction
    def _is_device_leaf(self, n: TreeNode) -> bool:
        return bool(n.device_pages) and n.lock_ref == 0 and not any(
            c.device_pages for c in n.children.values())

    def evict(self, num_pages: int) -> int:
        """Free device pages of unlocked device leaves in policy order. A backed-up node (or,
        under write_back, one we can write out now) stays as host-only; others are dropped."""
        if num_pages <= 0:
            return 0
        heap = [(self._priority(n), n.id, n) for n in self.nodes() if self._is_device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            k = node.num_pages
            if node.host_pages is None and self.write_policy == "write_back":
                self._write_now(node)
            parent = node.parent
            self._free_device(node)
            self._evictable_pages -= k
            freed += k
            if node.host_pages is not None:
                node.device_pages = []
                self.stats.demoted_pages += k
            else:
                self._drop_subtree(node)
            if parent is not self.root and self._is_device_leaf(parent):
                heapq.heappush(heap, (self._priority(parent), parent.id, parent))
        return freed

    def _drop_subtree(self, node: TreeNode) -> None:
        """Remove `node` (device pages already freed) and its host-only descendants. A host
        copy a storage backup still reads is freed by the backup's end instead."""
        del node.parent.children[node.key[:self.page_size]]
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            assert not n.device_pages and n.pending_job is None
            if n.host_pages and n.host_ref == 0:
                self._free_host(n)
            n.parent = None
            stack.extend(n.children.values())
        node.parent = None

    def evict_host(self, num_pages: int) -> int:
        """Free host copies of host-only leaves (never a node being written, nor one a storage
        backup is reading)."""
        heap = [(self._priority(n), n.id, n) for n in self.nodes()
                if not n.children and not n.device_pages and n.pending_job is None
                and n.host_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            self._free_host(node)
            freed += len(node.host_pages)
            parent = node.parent
            del parent.children[node.key[:self.page_size]]
            node.parent = None
            if (parent is not self.root and not parent.children and not parent.device_pages
                    and parent.pending_job is None and parent.host_ref == 0):
                heapq.heappush(heap, (self._priority(parent), parent.id, parent))
        return freed

    # ------------------------------------------------------------------ admin
    def reset(self) -> bool:
        if self._jobs or self._protected_pages > 0 or (self.storage and self.storage.busy()):
            return False
        for node in self.nodes():
            if node.host_pages:
                self.host_allocator.free(node.host_pages)
            if node.device_pages:
                self.allocator.free(node.device_pages)
        self._init_tree()
        return True

    def check_integrity(self) -> None:
        self.check_tree_shape()  # the base tree's invariants, then the two tiers'
        P = self.page_size
        evictable = protected = 0
        dev_seen: set[int] = set()
        host_seen: set[int] = set()
        for node in self.nodes():
            k = len(node.key) // P
            assert node.key and len(node.key) == k * P, f"{node!r}: key not whole pages"
            assert node.device_pages or node.host_pages is not None, f"{node!r} holds nothing"
            if node.device_pages:
                assert len(node.device_pages) == k, f"{node!r}: device pages != key pages"
                assert node.parent is self.root or node.parent.device_pages, \
                    f"{node!r}: device node under a host-only parent"
                if node.lock_ref > 0:
                    protected += k
                else:
                    evictable += k
            for pages, seen, alloc, what in (
                    (node.device_pages, dev_seen, self.allocator, "device"),
                    (node.host_pages or [], host_seen, self.host_allocator, "host"),
                    (node.pending_host or [], host_seen, self.host_allocator, "host")):
                for p in pages:
                    assert p not in seen, f"{what} page {p} owned twice"
                    assert alloc.is_allocated(p), f"{what} page {p} of {node!r} not allocated"
                    seen.add(p)
        assert (evictable, protected) == (self._evictable_pages, self._protected_pages), (
            f"device counters ({self._evictable_pages}, {self._protected_pages}) != tree "
            f"({evictable}, {protected})")
        for p in self.held_elsewhere():  # a decode server's retraction backups
            assert p not in host_seen, f"host page {p} owned twice (a backup and the tree)"
            assert self.host_allocator.is_allocated(p), f"a backup holds free host page {p}"
            host_seen.add(p)
        if self.storage is not None:
            self.storage.check_integrity()
            for p in self.storage.held_host_pages():
                assert p not in host_seen, f"host page {p} owned twice (storage and tree)"
                assert self.host_allocator.is_allocated(p), f"storage holds free host page {p}"
                host_seen.add(p)
        assert self.host_allocator.num_used() == len(host_seen), (
            f"host page leak: {self.host_allocator.num_used()} used, tree, storage jobs and "
            f"backups hold {len(host_seen)}")
        self.allocator.check_integrity()
        self.host_allocator.check_integrity()
