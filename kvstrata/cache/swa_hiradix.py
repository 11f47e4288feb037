"""HiCache L2 with hybrid SWA memory (no torch): HiRadixCache's device/host residency plus
SWARadixCache's per-node SWA liveness (SGLang main's unified tree; our own code).

Per node: `device_pages`/`host_pages` as in hiradix_cache.py; `swa_tombstone` for a
device-resident node (its SWA pages freed, cache/swa_radix.py); `host_swa` for a host copy
that also holds the window layers' K/V. A host page id names both halves of the host copy:
the full layers' K/V in the host pool and the window layers' K/V under the same id in a host
SWA pool of as many pages (runner/executors/hicache.py). Why not an SWA host pool sized like
the device ratio with its own allocator: host RAM is the cheap tier, and one id per host page
keeps the host accounting (allocation, eviction, splits, pending writes, the integrity
check) exactly HiRadixCache's; the cost is the SWA half of host pages whose node was already
tombstoned when it was written (idle RAM, not wrong KV).

What moves:
  - a device->host write (write-through, selective, write-back on eviction) copies the full
    pages and, when the node is live, its SWA pages too (`host_swa` records which); a node
    being written is never tombstoned meanwhile (evict_swa skips it), so the SWA pages read
    stay the node's;
  - a demotion (device eviction) frees both the full and the SWA device pages;
  - a load-back gives each loaded node full pages and, where its host copy has them, SWA
    pages (mapped to the new full pages), else loads it as a tombstone;
  - a revival gives a device tombstone in the window before a match end SWA pages and its
    host copy's SWA half, nothing else (`_revive`).

Matching is window-aware over what will be resident after the load-back: a prefix of L
tokens is usable only if the pages covering its last window are live device nodes, host-only
nodes with `host_swa`, or device tombstones whose host copy has its SWA half (`_revivable`:
the load-back brings just that half back, `_revive`, into new SWA pages; the full pages stay).
So a match ending among the pages an earlier, longer load-back left as tombstones (a prompt
diverging inside that prefix) still hits. The match is cut back to the longest usable end;
the rest is recomputed, never read stale.

SWA eviction only tombstones (a node's full pages follow HiCache's device eviction, which
demotes or drops); under write_back it first writes a node without a host copy (both halves),
as device eviction does (and backs it up to L3). SWA locks are SWARadixCache's. HiCache L3
behind this tree: cache/swa_storage.py.
"""
from __future__ import annotations

from kvstrata.cache.hiradix_cache import HiMatchResult, HiRadixCache
from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.radix_cache import TreeNode
from kvstrata.cache.swa_pages import SWAPages
from kvstrata.cache.swa_radix import SWARadixCache
from kvstrata.protocol import TransferOp


class SWAHiRadixCache(HiRadixCache):
    def __init__(self, allocator: PageAllocator, page_size: int, host_allocator: PageAllocator,
                 swa: SWAPages, write_policy: str = "write_through",
                 eviction_policy: str = "lru"):
        self.swa = swa
        self.total_cut_tokens = 0
        self.total_healed_pages = 0
        self._load_live: set[int] = set()  # nodes whose load-back maps SWA pages (ids)
        self.swa_revived_pages = 0  # device tombstones' pages given their SWA half back
        super().__init__(allocator, page_size, host_allocator, write_policy, eviction_policy)

    def _init_tree(self) -> None:
        super()._init_tree()
        self._swa_evictable_pages = 0  # SWA pages of live device nodes, unlocked
        self._swa_protected_pages = 0  # ... and SWA-locked

    # The SWA lock, counters and new-node chain are SWARadixCache's as they are (no super()
    # calls in them).
    swa_lock = SWARadixCache.swa_lock
    swa_unlock = SWARadixCache.swa_unlock
    add_swa_nodes = SWARadixCache.add_swa_nodes
    evictable_swa_pages = SWARadixCache.evictable_swa_pages
    protected_swa_pages = SWARadixCache.protected_swa_pages
    cached_swa_pages = SWARadixCache.cached_swa_pages

    # ------------------------------------------------------------------ match
    def swa_after_load(self, node: TreeNode, device_only: bool = False) -> bool:
        """Will the node have SWA K/V on the device once the match is loaded back (with
        device_only: without any load)?"""
        if node.device_pages:
            return not node.swa_tombstone or (not device_only and self._revivable(node))
        return node.host_swa and node.host_pages is not None

    @staticmethod
    def _revivable(node: TreeNode) -> bool:
        """A device tombstone whose host copy holds its SWA half (not being written)."""
        return (node.swa_tombstone and node.host_swa and node.host_pages is not None
                and node.pending_job is None)

    def _usable_pages(self, token_ids: list[int], device_only: bool = False
                      ) -> tuple[int, int]:
        """(usable pages, matched pages) of the cached prefix, read-only: usable ends where
        the last window is SWA-resident after load-back (device_only: on the device now)."""
        P, need = self.page_size, self.swa.window_pages
        usable = len(token_ids) - len(token_ids) % P
        node, pos, total, run, best = self.root, 0, 0, 0, 0
        while pos < usable:
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None or (device_only and not child.device_pages):
                break
            matched = self.matching_pages(child.key, token_ids, pos, usable)
            if self.swa_after_load(child, device_only):
                run += matched  # a live node's last matched page is its best end
                if run >= min(need, total + matched):
                    best = total + matched
            else:
                run = 0
            total += matched
            if matched < len(child.key) // P:
                break
            pos += matched * P
            node = child
        return best, total

    def match_prefix(self, token_ids: list[int]) -> HiMatchResult:
        best, total = self._usable_pages(token_ids)
        keep = best * self.page_size
        match = super().match_prefix(token_ids[:keep])
        self.total_queried_tokens += len(token_ids) - keep  # the cut tail was queried too
        self.total_cut_tokens += (total - best) * self.page_size
        return match

    def peek_device_pages(self, token_ids: list[int]) -> int:
        return self._usable_pages(token_ids, device_only=True)[0]

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: list[int], pages: list[int]) -> int:
        """HiRadixCache.insert (same return value: the leading device-resident pages the tree
        had; host-only nodes adopt the caller's pages) with SWARadixCache's liveness: nodes
        are split so each is all-live or all-tombstoned, and a device tombstone adopts the
        caller's live SWA pages for the same tokens (healing)."""
        P = self.page_size
        if len(token_ids) != len(pages) * P:
            raise ValueError(f"insert needs whole pages: {len(token_ids)} tokens != "
                             f"{len(pages)} pages * {P}")
        now = self.tick()
        node, pos, device_known = self.root, 0, 0
        while pos < len(token_ids):
            child = node.children.get(self.page_key(token_ids, pos))
            if child is None:
                self._add_nodes(node, token_ids, pages, pos, now)
                break
            matched = self.matching_pages(child.key, token_ids, pos, len(token_ids))
            first = pos // P
            mine = pages[first:first + matched]
            if not child.device_pages:  # adopt: liveness is the caller's pages'
                flag = [self.swa.live(p) for p in mine]
            elif child.swa_tombstone:  # heal where the caller brings live SWA pages
                flag = [p != d and self.swa.live(p) for p, d in zip(mine, child.device_pages)]
            else:
                flag = [False] * matched
            run = 1
            while run < matched and flag[run] == flag[0]:
                run += 1
            if run < len(child.key) // P and (flag[0] or not child.device_pages
                                              or pos + run * P < len(token_ids)):
                child = self.split_node(child, run)
            child.last_access_time = now
            if not child.device_pages:
                child.device_pages = list(mine[:run])
                self._evictable_pages += run
                child.swa_tombstone = not flag[0]
                if flag[0]:
                    self._swa_evictable_pages += run
            else:
                device_known = first + run
                if flag[0]:
                    for full, own in zip(child.device_pages, mine[:run]):
                        self.swa.adopt(full, own)
                    child.swa_tombstone = False
                    self._swa_evictable_pages += run  # a tombstone holds no SWA lock
                    self.total_healed_pages += run
            pos += run * P
            node = child
        return device_known

    def _add_nodes(self, parent: TreeNode, token_ids: list[int], pages: list[int], pos: int,
                   now: int) -> None:
        """New nodes for the part the tree lacked (SWARadixCache.add_swa_nodes), each backed up
        under write_through."""
        for node in self.add_swa_nodes(parent, token_ids, pages, pos, now):
            if self.write_policy == "write_through":
                self._backup(node)

    def split_node(self, child: TreeNode, num_pages: int) -> TreeNode:
        upper = super().split_node(child, num_pages)
        # Locks and liveness cover whole nodes (swa_radix.py); the host copy is cut at the
        # same page and holds SWA K/V in both halves or neither.
        upper.swa_lock_ref = child.swa_lock_ref
        upper.swa_tombstone = child.swa_tombstone
        upper.host_swa = child.host_swa
        return upper

    # ------------------------------------------------------------------ copies
    def _copy_op(self, job: int, kind: str, device_pages: list[int], host_pages: list[int],
                 sync: bool, node: TreeNode | None = None) -> TransferOp:
        """A write takes the node's SWA pages while it is live; a load brings those the
        load-back mapped (0: a page loaded without SWA K/V)."""
        if kind == "d2h":
            node.host_swa = not node.swa_tombstone
            swa = [self.swa.map[p] for p in device_pages] if node.host_swa else []
        else:
            swa = [self.swa.map[p] for p in device_pages]
            swa = swa if any(swa) else []
        return TransferOp(job, kind, device_pages, host_pages, sync=sync, swa_pages=swa)

    def _window_of_load(self, match: HiMatchResult) -> list[tuple[TreeNode, int]]:
        """The host-only nodes a load-back of `match` gives device pages, match end first,
        each with how many of its last pages load with their SWA half: only those of the
        last window before the match end (window_pages), where the host copy has them. The
        earlier pages load as tombstones (full layers only): no request reads their SWA
        K/V from this end, and their host copy keeps it. So a host prefix longer than the
        SWA pool loads back as long as its window fits (a running request keeps no more:
        free_out_of_window). Then the device nodes the rest of that window lies in, each
        with how many of its last pages get their SWA half back (`_revive`: tombstones)."""
        out, node, need = [], match.last_host_node or match.last_node, self.swa.window_pages
        while node is not None and node is not self.root and not node.device_pages:
            k = len(node.host_pages)
            out.append((node, min(k, need) if node.host_swa else 0))
            need = max(0, need - k)
            node = node.parent
        while need > 0 and node is not None and node is not self.root:
            k = node.num_pages
            if self._revivable(node):
                out.append((node, min(k, need)))
            need -= k
            node = node.parent
        return out

    def swa_pages_to_load(self, match: HiMatchResult) -> int:
        """SWA pages a load-back of `match` takes (`_window_of_load`)."""
        return sum(live for _, live in self._window_of_load(match))

    def load_back(self, match: HiMatchResult, device_pages: list[int]) -> TreeNode:
        """HiRadixCache.load_back with only the last window's pages live (`_window_of_load`):
        a node the window starts inside is split there, so each stays all-live or
        all-tombstoned. A match without a host part (only tombstones to revive) returns its
        last node."""
        self._load_live = set()
        for node, live in self._window_of_load(match):
            k = len(node.key) // self.page_size
            if live and live < k:
                self.split_node(node, k - live)  # (node keeps the tail)
            if live and node.device_pages:
                self._revive(node)
            elif live:
                self._load_live.add(id(node))
        if not match.host_pages:
            return match.last_node
        try:
            return super().load_back(match, device_pages)
        finally:
            self._load_live = set()

    def needs_load(self, match: HiMatchResult) -> bool:
        """Does a match without a host part still need a load-back (tombstones to revive)?"""
        return any(node.device_pages for node, live in self._window_of_load(match) if live)

    def _revive(self, node: TreeNode) -> None:
        """A device tombstone gets SWA pages and its host copy's SWA half (one sync op that
        moves nothing else: its full pages may be read by running requests)."""
        ok = self.swa.alloc_for(node.device_pages)
        assert ok, "no SWA pages to revive a tombstone: make room first"
        node.swa_tombstone = False
        self._swa_evictable_pages += node.num_pages
        self.swa_revived_pages += node.num_pages
        self.queue_op(TransferOp(next(self._job_ids), "h2d", list(node.device_pages),
                               list(node.host_pages), sync=True, swa_only=True,
                               swa_pages=[self.swa.map[p] for p in node.device_pages]))

    def _adopt_loaded(self, node: TreeNode, device_pages: list[int]) -> None:
        super()._adopt_loaded(node, device_pages)
        # The caller (KVManager) made room in both pools for the window's pages.
        want = id(node) in self._load_live
        live = want and self.swa.alloc_for(device_pages)
        assert live or not want, "no SWA pages for a load-back: make room first"
        node.swa_tombstone = not live
        if live:
            self._swa_evictable_pages += len(device_pages)

    def _free_device(self, node: TreeNode) -> None:
        """A demoted or dropped node's device pages go with their SWA pages (unlocked:
        evict only takes unlocked nodes, and an SWA lock needs a full lock)."""
        if not node.swa_tombstone:
            self.swa.free_swa(node.device_pages)
            self._swa_evictable_pages -= node.num_pages
        node.swa_tombstone = False  # host-only: liveness is host_swa's until loaded
        super()._free_device(node)

    # ------------------------------------------------------------------ SWA eviction
    def evict_swa(self, num_pages: int) -> int:
        """Tombstone unlocked live device nodes in policy order until `num_pages` SWA pages
        are free (their full pages stay: device eviction demotes them later). A node whose
        host write is in flight is skipped: that write reads its SWA pages."""
        if num_pages <= 0:
            return 0
        nodes = [n for n in self.nodes() if n.device_pages and not n.swa_tombstone
                 and n.swa_lock_ref == 0 and n.pending_job is None]
        nodes.sort(key=lambda n: (self._priority(n), n.id))
        freed = 0
        for node in nodes:
            if freed >= num_pages:
                break
            if self.write_policy == "write_back" and node.host_pages is None:
                # write_back writes on eviction: this one takes the SWA half, so the host
                # copy keeps a usable window (sync: before the freed pages are reused).
                host = self.alloc_host(node.num_pages)
                if host is not None:
                    self.queue_op(self._copy_op(next(self._job_ids), "d2h",
                                              list(node.device_pages), list(host), sync=True,
                                              node=node))
                    node.host_pages = host
                    self.stats.d2h_pages += node.num_pages
                    if self.storage is not None:  # as HiRadixCache.evict: after the write
                        self.storage.backup(node)
            self.swa.free_swa(node.device_pages)
            node.swa_tombstone = True
            self._swa_evictable_pages -= node.num_pages
            freed += node.num_pages
        return freed

    # ------------------------------------------------------------------ admin
    def reset(self) -> bool:
        if self._jobs or self._protected_pages > 0 or (self.storage and self.storage.busy()):
            return False
        for node in self.nodes():
            if node.device_pages and not node.swa_tombstone:
                self.swa.free_swa(node.device_pages)
        return super().reset()

    def check_integrity(self) -> None:
        super().check_integrity()
        evictable = protected = 0
        for node in self.nodes():
            assert node.swa_lock_ref <= node.lock_ref, f"{node!r}: SWA lock without a full lock"
            swa = [self.swa.map[p] for p in node.device_pages]
            if not node.device_pages or node.swa_tombstone:
                assert not any(swa), f"{node!r}: tombstone maps to SWA pages {swa}"
                assert node.swa_lock_ref == 0, f"{node!r}: SWA lock without SWA pages"
                continue
            assert all(swa), f"{node!r}: live node has pages without an SWA page: {swa}"
            if node.swa_lock_ref:
                protected += node.num_pages
            else:
                evictable += node.num_pages
        assert (evictable, protected) == (self._swa_evictable_pages, self._swa_protected_pages), (
            f"SWA counters (evictable={self._swa_evictable_pages}, protected="
            f"{self._swa_protected_pages}) != tree (evictable={evictable}, protected={protected})")
