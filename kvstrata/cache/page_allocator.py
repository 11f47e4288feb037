"""Page allocator for one KV tier: hands out page ids, never touches tensors.

Page ids are 1..num_pages. Page 0 is the padding sink (slots 0..page_size-1 of the device
pool): padded batch entries and unallocated req_to_token cells point at it, so it must never
hold real KV and is never handed out.

`alloc` always returns the lowest free ids first. That keeps page ids deterministic for tests
(exact ids can be asserted after any sequence of alloc/free). Free pages are of two kinds:
pages never handed out, the range `_next_fresh..num_pages` (a counter, not a list: a
default-sized CPU pool has millions of pages and building them as a list and a set cost over a
second of every server start), and pages given back, a min-heap that only ever holds ids below
`_next_fresh` -- so heap first, then the fresh range, is ascending. O(n log N) per call. A set
mirrors the heap for O(1) double-free detection, and an explicit `_used` set lets
`check_integrity` catch bookkeeping bugs in this class itself.
"""
from __future__ import annotations

import heapq


# Above this many pages ever handed out, check_integrity skips the O(pages handed out)
# free-heap checks (see there): on busy test servers they were ~20% of the step time.
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
        self._free_heap = []
        self._free_set = set()
        self._used = set()
        self._next_fresh = 1

    def available_pages(self) -> int:
        return len(self._free_heap) + self.num_pages + 1 - self._next_fresh

    def num_used(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self.available_pages():
            return None
        pages = [heapq.heappop(self._free_heap) for _ in range(min(n, len(self._free_heap)))]
        self._free_set.difference_update(pages)
        fresh = n - len(pages)
        pages.extend(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
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
        Runs after every step under KVSTRATA_CHECK_INTEGRITY: once more than FULL_CHECK_PAGES
        pages were ever handed out it runs the checks that cost O(pages in use) -- counts,
        and every used page in range and not free -- which still catch any leak or double
        ownership; the free heap's own shape is checked in full below that (the allocator's
        unit tests use small pools)."""
        assert self._next_fresh <= self.num_pages + 1, (
            f"fresh range starts at {self._next_fresh}, past num_pages {self.num_pages}")
        handed_out = self._next_fresh - 1  # pages 1.._next_fresh-1 are used or given back
        if handed_out > FULL_CHECK_PAGES:
            self._check_used_pages()
            return
        heap_set = set(self._free_heap)
        assert len(heap_set) == len(self._free_heap), "free heap holds a page twice"
        assert heap_set == self._free_set, (
            f"free heap and free set disagree: only in heap {sorted(heap_set - self._free_set)}, "
            f"only in set {sorted(self._free_set - heap_set)}"
        )
        fresh_too = [p for p in heap_set if p >= self._next_fresh]
        assert not fresh_too, (
            f"pages free twice (in the free heap and the never-used range): {sorted(fresh_too)}")
        both = [p for p in self._used if p in self._free_set or p >= self._next_fresh]
        assert not both, f"pages both free and used: {sorted(both)}"
        everything = self._free_set | self._used
        out_of_range = [p for p in everything if not 1 <= p <= self.num_pages]
        assert not out_of_range, f"page ids out of range 1..{self.num_pages}: {sorted(out_of_range)}"
        assert len(self._free_set) + len(self._used) == handed_out, (
            f"free ({self.available_pages()}) + used ({len(self._used)}) != num_pages "
            f"({self.num_pages}); missing: {sorted(set(range(1, self._next_fresh)) - everything)}"
        )

    def _check_used_pages(self) -> None:
        assert len(self._free_heap) == len(self._free_set), (
            f"free heap ({len(self._free_heap)}) and free set ({len(self._free_set)}) differ")
        bad = [p for p in self._used
               if p in self._free_set or not 1 <= p < self._next_fresh]
        assert not bad, f"used pages that are free or out of range 1..{self.num_pages}: {bad[:16]}"
        assert self.available_pages() + len(self._used) == self.num_pages, (
            f"free ({self.available_pages()}) + used ({len(self._used)}) != num_pages "
            f"({self.num_pages})")

    def __repr__(self) -> str:
        return (
            f"PageAllocator(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"free={self.available_pages()}, used={len(self._used)})"
        )
