"""Request-facing KV facade over the page allocator and the radix cache (no torch).

The scheduler never touches pages directly; it asks this class to match a prefix, reserve
pages for new tokens, hand computed pages to the tree, and release a request. The request
object is duck-typed (cache/ must not import engine/); it carries:
`pages`, `num_tree_pages`, `last_node`, `num_computed_tokens`, `row_stale_from`, `all_ids`,
`cache_salt` (None, or the salt its cached prefixes are shared under: page_keys.salted_ids).

Page ownership for one request (page size P):

    pages[0 : num_tree_pages]        owned by the radix tree, pinned by last_node's lock
    pages[num_tree_pages : ]         owned by the request (freed or adopted by the tree later)

Hybrid SWA memory (plan.has_swa_pool): every full page also has an SWA page for the
sliding-window layers until it falls out of every window (cache/swa_pages.py; the tree's side
in cache/swa_radix.py). `swa_slots` gives the runner those slots; `free_out_of_window` is the
per-step release; capacity is the smaller of the two pools.

Recurrent state (plan.has_state_pool): each running request computes in a state slot of its
own and the tree keeps state snapshots beside its pages (cache/state_slots.py,
cache/state_radix.py): a match ends where a snapshot does, a finished request caches its K/V
up to the snapshot it leaves.

The facade's other halves are mixins: capacity accounting (cache/kv_capacity.py) and the tiers
behind the device pool -- retraction backups, HiCache load-back and tier ops, L3 prefetch
(cache/kv_tiers.py).
"""
from __future__ import annotations

from typing import Any, Iterable

from kvstrata.cache.hiradix_cache import HiRadixCache
from kvstrata.cache.kv_capacity import KVCapacity
from kvstrata.cache.kv_tiers import KVTiers, _cache_ids
from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.page_keys import salted_ids
from kvstrata.cache.radix_cache import RadixCache
from kvstrata.cache.state_hiradix import resume_at_state, state_hicache
from kvstrata.cache.state_radix import StateRadixCache
from kvstrata.cache.state_slots import StateSlots
from kvstrata.cache.state_storage import StateStorageTier
from kvstrata.cache.storage_tier import PREFETCH_CAPACITY_SHARE, PrefetchConfig, StorageTier
from kvstrata.cache.swa_pages import SWAPages
from kvstrata.cache.swa_hiradix import SWAHiRadixCache
from kvstrata.cache.swa_radix import SWARadixCache
from kvstrata.cache.swa_storage import SWAStorageTier
from kvstrata.config.kv_plan import KVPlan

# Host parts shorter than this many pages are recomputed: a load has a fixed cost.
LOAD_BACK_THRESHOLD_PAGES = 1


class KVManager(KVCapacity, KVTiers):
    def __init__(self, plan: KVPlan, disable_radix_cache: bool = False,
                 eviction_policy: str = "lru", hicache_write_policy: str = "write_through",
                 storage: PrefetchConfig | None = None, backups_share_host: bool = False,
                 state_track_interval: int | None = None):
        """Page ids for `plan`'s pools. A host pool in the plan is either HiCache L2 (a host
        tier behind the radix tree) or, with host_pool_use "retraction", a decode server's
        store for retracted requests' KV backups (no tree: `alloc_backup_pages`). `storage`:
        HiCache L3 is on (cache/storage_tier.py), with this prefetch policy.
        `backups_share_host`: a decode server with HiCache and host_pool retraction backups:
        one host pool, sized by the HiCache flags, holds both; a backup takes free host pages
        first, then evicts host-only cached pages (SGLang reclaims evictable host pages
        first), and the tree's integrity check counts the backups' pages as used.
        `state_track_interval`: with a state pool, extra_buffer's track cadence (None:
        no_buffer)."""
        self.plan = plan
        page_size = self.page_size = plan.page_size
        self.allocator = PageAllocator(plan.num_pages, page_size)
        self.swa: SWAPages | None = None
        self.states: StateSlots | None = None
        if plan.has_state_pool and (plan.has_swa_pool or plan.has_host_pool
                                    and plan.host_pool_use != "hicache"):
            raise ValueError("a recurrent state pool beside an SWA pool or a retraction host "
                             "pool is not built yet")
        if plan.has_swa_pool:
            # HiCache L2 / L3 (cache/swa_hiradix.py, swa_storage.py) and retraction backups
            # (the host pool's SWA half: runner/executors/retraction_backup.py) copy SWA pages.
            self.swa = SWAPages(plan.num_swa_pages, plan.num_pages, page_size, plan.swa_window)
        self.hicache = plan.has_host_pool and plan.host_pool_use == "hicache"
        self.backup_pool = plan.has_host_pool and (plan.host_pool_use == "retraction"
                                                   or backups_share_host)
        self._backup_pages: set[int] = set()  # host pages held by retraction backups
        if self.backup_pool and not self.hicache:
            self.host_allocator = PageAllocator(plan.num_host_pages, page_size)
        if self.hicache:
            if disable_radix_cache:
                raise ValueError("--enable-hierarchical-cache needs the radix cache; "
                                 "drop --disable-radix-cache")
            self.host_allocator = PageAllocator(plan.num_host_pages, page_size)
            if self.swa is not None:
                self.tree: RadixCache = SWAHiRadixCache(
                    self.allocator, page_size, self.host_allocator, self.swa,
                    hicache_write_policy, eviction_policy)
            elif plan.has_state_pool:  # host copies of snapshots too (cache/state_hiradix.py)
                self.tree, self.states = state_hicache(plan, self.allocator, self.host_allocator,
                                                       hicache_write_policy, eviction_policy,
                                                       state_track_interval)
            else:
                self.tree = HiRadixCache(self.allocator, page_size, self.host_allocator,
                                         hicache_write_policy, eviction_policy)
            self.tree.held_elsewhere = lambda: self._backup_pages
            if storage is not None:
                capacity = int(PREFETCH_CAPACITY_SHARE * (plan.num_host_pages - plan.num_pages))
                tier = (SWAStorageTier if self.swa is not None else
                        StateStorageTier if self.states is not None else StorageTier)
                self.tree.storage = tier(self.tree, storage, max(capacity, 0))
        elif storage is not None:
            raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
        elif plan.has_state_pool:
            slots = PageAllocator(plan.num_state_slots, 1)
            self.tree = StateRadixCache(self.allocator, page_size, slots,
                                        disable=disable_radix_cache,
                                        eviction_policy=eviction_policy)
            self.states = StateSlots(slots, self.tree, page_size, state_track_interval)
        elif self.swa is not None:
            self.tree = SWARadixCache(self.allocator, page_size, self.swa,
                                      disable=disable_radix_cache, eviction_policy=eviction_policy)
        else:
            self.tree = RadixCache(self.allocator, page_size, disable=disable_radix_cache,
                                   eviction_policy=eviction_policy)
        self.matched_tokens = 0
        self.queried_tokens = 0

    # ------------------------------------------------------------------ prefix
    def peek_prefix_len(self, token_ids: list[int], whole_prompt: bool = False,
                        salt: str | None = None) -> int:
        """Device-resident matched length, with no side effect on the tree (no split, no
        access stamp or hit count, no stats): for lpm ordering and admission dry runs.
        `salt`: the request's cache salt (its prefixes are shared only under it)."""
        return self.tree.peek_device_pages(
            self._matchable(salted_ids(token_ids, salt), whole_prompt)) * self.page_size

    def match_and_lock(self, req: Any, use_cache: bool = True,
                       whole_prompt: bool = False) -> int:
        """Attach the longest cached prefix to a request that holds no KV; returns its length.

        The last prompt token is never matched: its logits are needed to sample, so a
        full-prompt hit still recomputes it -- unless `whole_prompt` (a PD decode server,
        which receives the first token instead of sampling it). use_cache=False matches
        nothing (a request that wants every prompt token's logprob must compute them all)."""
        assert not req.pages and req.last_node is None
        ids = _cache_ids(req)
        match = self.tree.match_prefix(self._matchable(ids, whole_prompt) if use_cache else [])
        self.tree.lock(match.last_node)
        if self.hicache and (len(match.host_pages) >= LOAD_BACK_THRESHOLD_PAGES
                             or self.swa is not None and self.tree.needs_load(match)):
            match = self._load_back(ids, match, whole_prompt)
        if self.hicache and self.states is not None:  # its end's snapshot on the device
            match = resume_at_state(self.tree, match)
        req.last_node = match.last_node
        req.pages = list(match.device_pages)
        req.num_tree_pages = len(req.pages)
        req.swa_evicted_pages = 0
        self._swa_lock(req)
        if self.states is not None:  # its first forward copies the node's snapshot
            kv_end = self.tree.peek_kv_pages(self._matchable(ids, whole_prompt)) \
                if use_cache else 0
            self.states.on_match(req, match.last_node, kv_end * self.page_size)
        req.num_computed_tokens = len(req.pages) * self.page_size
        req.row_stale_from = 0
        self.queried_tokens += len(ids)
        self.matched_tokens += req.num_computed_tokens
        return req.num_computed_tokens

    def _matchable(self, ids: list[int], whole_prompt: bool = False) -> list[int]:
        """The whole pages a match may cover: all but the last token, or every token."""
        usable = (len(ids) - (0 if whole_prompt else 1)) // self.page_size * self.page_size
        return ids[:max(usable, 0)]

    # ------------------------------------------------------------------ recurrent state
    def assign_state_slot(self, req: Any) -> bool:
        """An admitted request's working state slot (True without a state pool)."""
        return self.states is None or self.states.assign(req)

    def state_fields(self, req: Any, end: int, chunk_end: bool, num_draft: int = 0) -> dict:
        """ScheduledRequest's state fields ({} without a state pool; StateSlots)."""
        return {} if self.states is None else self.states.entry_fields(req, end, chunk_end,
                                                                       num_draft)

    def after_forward(self) -> None:
        if self.states is not None:
            self.states.after_forward()

    # ------------------------------------------------------------------ growth
    def pages_needed(self, req: Any, upto_tokens: int) -> int:
        return max(-(-upto_tokens // self.page_size) - len(req.pages), 0)

    def grow(self, req: Any, upto_tokens: int) -> bool:
        """Make req.pages cover positions [0, upto_tokens). False (nothing changed) if no room."""
        need = self.pages_needed(req, upto_tokens)
        if need == 0:
            return True
        if not self.ensure_free_pages(need):
            return False
        new_pages = self.allocator.alloc(need)
        if new_pages is None:
            return False
        if self.swa is not None and not self.swa.alloc_for(new_pages):
            self.allocator.free(new_pages)
            return False
        req.pages.extend(new_pages)
        return True

    def _free(self, pages: list[int]) -> None:
        """Free full pages, with their SWA pages."""
        if self.swa is not None:
            self.swa.free_swa(pages)
        self.allocator.free(pages)

    def trim(self, req: Any, upto_tokens: int) -> None:
        """Free the request's pages past those covering positions [0, upto_tokens): the
        pages of rejected draft tokens (a page partly used by committed tokens stays)."""
        keep = max(-(-upto_tokens // self.page_size), req.num_tree_pages)
        if len(req.pages) > keep:
            self._free(req.pages[keep:])
            del req.pages[keep:]

    def slots(self, req: Any, start: int, end: int) -> list[int]:
        P = self.page_size
        return [req.pages[i // P] * P + i % P for i in range(start, end)]

    def swa_slots(self, req: Any, start: int, end: int) -> list[int] | None:
        """The SWA slots of positions [start, end) (0 where the page has none: out of every
        window, never read), for ScheduledRequest.swa_slots; None without an SWA pool."""
        return None if self.swa is None else self.swa.slots(req.pages, start, end)

    def free_out_of_window(self, req: Any) -> None:
        """Release the SWA pages no query of the request reads again (SWAPages.release);
        call for each running request at each step, before scheduling."""
        if self.swa is not None:
            self.swa.release(self.tree, req)

    def _swa_lock(self, req: Any, lock: bool = True) -> None:
        if self.swa is not None:  # after the full lock / before the full unlock
            (self.swa.lock if lock else self.swa.unlock)(self.tree, req)

    # ------------------------------------------------------------------ hand-over
    def cache_unfinished(self, req: Any) -> None:
        """Between prefill chunks: give the computed whole pages to the tree so the next chunk
        (and other requests) reuse them; the request keeps a lock on them."""
        if self.tree.disable:
            return
        full = req.num_computed_tokens // self.page_size
        if full <= req.num_tree_pages:
            return
        key = _cache_ids(req)[:full * self.page_size]
        self.tree.insert(key, req.pages[:full])
        match = self.tree.match_inserted(key)
        tree_pages = match.device_pages
        assert len(tree_pages) == full, (len(tree_pages), full)
        # Pages someone else inserted meanwhile are duplicates of ours: drop ours and point
        # the request (and its req_to_token row) at the tree's copy.
        duplicates = []
        for i in range(req.num_tree_pages, full):
            if req.pages[i] != tree_pages[i]:
                duplicates.append(req.pages[i])
                req.pages[i] = tree_pages[i]
                req.row_stale_from = min(req.row_stale_from, i * self.page_size)
        if duplicates:
            self._free(duplicates)
        self._swa_lock(req, lock=False)
        self.tree.lock(match.last_node)
        self.tree.unlock(req.last_node)
        req.last_node = match.last_node
        req.num_tree_pages = full
        self._swa_lock(req)
        if self.states is not None:  # the snapshot the chunk took, at its end
            self.states.after_chunk(req, match.last_node, full * self.page_size)

    def cache_prompt(self, req: Any) -> None:
        """A prompt's prefill is done. With an SWA pool its whole pages go to the tree now
        (SGLang's cache_unfinished_req after prefill): the request then SWA-locks only their
        last window, so its decode leaves the older ones cached (SWA-evictable) instead of
        freeing them as its own, and the same prompt, sent again while it decodes or after,
        hits past the window. Without one, pages stay the request's until it finishes (nothing
        is freed early, so nothing is lost by waiting)."""
        if self.swa is not None:
            self.cache_unfinished(req)

    def release(self, req: Any, insert: bool) -> None:
        """Drop a request's KV. With insert, its computed whole pages go to the tree first
        (finished/aborted requests); without, everything it owns is freed (retraction)."""
        to_free: list[int] = []
        keep = req.num_tree_pages
        cache = insert and not self.tree.disable
        ids = _cache_ids(req) if cache else []
        # With recurrent state, K/V past the snapshot the request leaves could never be
        # resumed: cache up to it only (StateSlots.donation).
        snap = self.states.donation(req) if cache and self.states is not None else (0, 0)
        if cache:
            full = (snap[0] if self.states is not None else req.num_computed_tokens) \
                // self.page_size
            if full > req.num_tree_pages:
                already = self.tree.insert(ids[:full * self.page_size], req.pages[:full])
                # [num_tree_pages, already): the tree had its own copy -> ours are duplicates.
                to_free.extend(req.pages[req.num_tree_pages:max(already, req.num_tree_pages)])
                keep = full
        to_free.extend(req.pages[keep:])
        if to_free:
            self._free(to_free)
        if self.states is not None:
            self.states.release(req, ids, *snap)
        if req.last_node is not None:
            self._swa_lock(req, lock=False)
            self.tree.unlock(req.last_node)
        req.pages = []
        req.num_tree_pages = 0
        req.last_node = None
        req.swa_evicted_pages = 0

    def flush(self) -> bool:
        return self.tree.reset()

    # ------------------------------------------------------------------ checks
    def hit_rate(self) -> float:
        return self.matched_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def check_integrity(self, live_requests: Iterable[Any]) -> None:
        """free + held by requests + cached in the tree == total pages (both pools)."""
        live_requests = list(live_requests)
        self.allocator.check_integrity()
        self.tree.check_integrity()
        own = 0
        seen: set[int] = set()
        for req in live_requests:
            mine = req.pages[req.num_tree_pages:]
            assert not (seen & set(mine)), f"request {req.rid} shares pages with another"
            seen.update(mine)
            own += len(mine)
        free = self.allocator.available_pages()
        cached = self.tree.cached_pages()
        total = self.allocator.num_pages
        assert free + own + cached == total, (
            f"KV page leak: free {free} + in use {own} + cached {cached} != total {total}")
        if self.swa is not None:
            self.swa.check_requests(live_requests, self.tree)
        if self.states is not None:
            self.states.check(live_requests)
