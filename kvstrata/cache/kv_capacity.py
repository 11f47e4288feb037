"""KVManager's capacity accounting (no torch): tokens free, evictable, allocatable and in use
in the main pool and, with hybrid SWA memory, the SWA pool (the smaller of the two bounds what
a new page can get), and the eviction that makes room. A mixin: it reads the manager's
allocators, tree and SWA pool.
"""
from __future__ import annotations


class KVCapacity:
    # ------------------------------------------------------------------ capacity
    @property
    def total_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    def available_tokens(self) -> int:
        return self.allocator.available_pages() * self.page_size

    def evictable_tokens(self) -> int:
        return self.tree.evictable_pages() * self.page_size

    def full_allocatable_tokens(self) -> int:
        """Free now plus what evicting unlocked cached pages would free (main pool)."""
        return self.available_tokens() + self.evictable_tokens()

    def swa_allocatable_tokens(self) -> int | None:
        """The same for the SWA pool (None without one): free plus SWA-unlocked cached."""
        if self.swa is None:
            return None
        return (self.swa.allocator.available_pages() + self.tree.evictable_swa_pages()) \
            * self.page_size

    def allocatable_tokens(self) -> int:
        """Tokens that can get pages now: every new page needs an SWA page too, so with an
        SWA pool the smaller of the two (SGLang's available_size = min(full, swa))."""
        swa = self.swa_allocatable_tokens()
        full = self.full_allocatable_tokens()
        return full if swa is None else min(full, swa)

    def used_tokens(self) -> int:
        """Tokens held by requests or pinned in the tree (not reclaimable now)."""
        return (self.allocator.num_used() - self.tree.evictable_pages()) * self.page_size

    def ensure_free_pages(self, num_pages: int, swa_pages: int | None = None) -> bool:
        """Evict just the shortfall from the tree; True when num_pages are free afterwards
        (and `swa_pages` SWA pages, by default as many: a new page takes one too)."""
        shortfall = num_pages - self.allocator.available_pages()
        if shortfall > 0:
            self.tree.evict(shortfall)
        ok = self.allocator.available_pages() >= num_pages
        if self.swa is not None:
            swa_pages = num_pages if swa_pages is None else swa_pages
            shortfall = swa_pages - self.swa.allocator.available_pages()
            if shortfall > 0:
                self.tree.evict_swa(shortfall)
            ok = ok and self.swa.allocator.available_pages() >= swa_pages
        return ok
