"""Page allocator for one KV tier: hands out page ids, never touches tensors.

Page ids are 1..num_pages. Page 0 is the padding sink (slots 0..page_size-1 of the device
pool): padded batch entries and unallocated req_to_token cells point at it, so it must never
hold real KV and is never handed out.

Free pages live in a min-heap so `alloc` always returns the lowest free ids first. That keeps
page ids deterministic for tests (exact ids can be asserted after any sequence of alloc/free)
and is O(n log N) per call. A set mirrors the heap for O(1) double-free detection, and an
explicit `_used` set lets `check_integrity` catch bookkeeping bugs in this class itself.
"""
from __future__ import annotations

import heapq


# Above this many pages check_integrity skips the O(pool) free-list checks (see there). The
# test servers' 16k-page pools are above it: the O(pool) checks were ~20% of their step time.
FULL_CHECK_PAGES = 1 << 12


class PageAllocator:
    """Pages 1..num_pages are allocatable; page 0 is the padding sink and never handed out.

    Contract:
      - `alloc(n)` is all-or-nothing: it returns n page ids in ascending order, or None and
        changes nothing when fewer than n are free. `alloc(0)` returns [].
      - `free(pages)` is all-or-nothing too: every id is validated before any is freed, so a
        bad call (page 0, out of range, not allocated, listed twice) raises ValueError and
        leaves the allocator unchanged.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free_heap: list[int] = []
        self._free_set: set[int] = set()
        self._used: set[int] = set()
        self.reset()

    def reset(self) -> None:
        """Mark every page free again (used by flush paths and tests)."""
        # An ascending list already satisfies the heap property.
        self._free_heap = list(range(1, self.num_pages + 1))
        self._free_set = set(self._free_heap)
        self._used = set()

    def available_pages(self) -> int:
        return len(self._free_heap)

    def num_used(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_heap):
            return None
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        self._free_set.difference_update(pages)
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        # Validate everything first so a bad call cannot leave the allocator half-updated.
        seen: set[int] = set()
        for page in pages:
            if page == 0:
                raise ValueError("page 0 is the padding sink and is never allocated; cannot free it")
            if not 1 <= page <= self.num_pages:
                raise ValueError(f"page {page} is out of range 1..{self.num_pages}")
            if page in seen:
                raise ValueError(f"page {page} is listed twice in one free() call")
            if page not in self._used:
                raise ValueError(f"page {page} is not allocated (double free?)")
            seen.add(page)
        for page in pages:
            heapq.heappush(self._free_heap, page)
        self._free_set.update(pages)
        self._used.difference_update(pages)

    def is_allocated(self, page: int) -> bool:
        return page in self._used

    def check_integrity(self) -> None:
        """Raise AssertionError (with the offending ids) if the free/used books disagree.
        Runs after every step under KVSTRATA_CHECK_INTEGRITY: a pool larger than
        FULL_CHECK_PAGES (a default-sized pool holds millions of pages) gets the checks that
        cost O(pages in use) -- counts, and every used page in range and not free -- which
        still catch any leak or double ownership; the free list's own shape is checked in
        full below that size (the allocator's unit tests use small pools)."""
        if self.num_pages > FULL_CHECK_PAGES:
            self._check_used_pages()
            return
        heap_set = set(self._free_heap)
        assert len(heap_set) == len(self._free_heap), "free heap holds a page twice"
        assert heap_set == self._free_set, (
            f"free heap and free set disagree: only in heap {sorted(heap_set - self._free_set)}, "
            f"only in set {sorted(self._free_set - heap_set)}"
        )
        both = self._free_set & self._used
        assert not both, f"pages both free and used: {sorted(both)}"
        everything = self._free_set | self._used
        out_of_range = [p for p in everything if not 1 <= p <= self.num_pages]
        assert not out_of_range, f"page ids out of range 1..{self.num_pages}: {sorted(out_of_range)}"
        assert len(self._free_set) + len(self._used) == self.num_pages, (
            f"free ({len(self._free_set)}) + used ({len(self._used)}) != num_pages ({self.num_pages}); "
            f"missing: {sorted(set(range(1, self.num_pages + 1)) - everything)}"
        )

    def _check_used_pages(self) -> None:
        assert len(self._free_heap) == len(self._free_set), (
            f"free heap ({len(self._free_heap)}) and free set ({len(self._free_set)}) differ")
        bad = [p for p in self._used if p in self._free_set or not 1 <= p <= self.num_pages]
        assert not bad, f"used pages that are free or out of range 1..{self.num_pages}: {bad[:16]}"
        assert len(self._free_set) + len(self._used) == self.num_pages, (
            f"free ({len(self._free_set)}) + used ({len(self._used)}) != num_pages "
            f"({self.num_pages})")

    def __repr__(self) -> str:
        return (
            f"PageAllocator(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"free={len(self._free_heap)}, used={len(self._used)})"
        )
