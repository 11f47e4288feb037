"""Page regions of a transfer manager: the main pool's buffers, with hybrid SWA memory the SWA
pool's buffers (SGLang's per-state-type payload, StateType.SWA), and with recurrent state the
state pool's (StateType.MAMBA: one "page" per state slot, kv/state_pool.py page_buffers).

A room's page list stays one list of ids (cache/swa_pd.py, cache/state_pd.py): region r's
pages are the ids from `bases[r]` on (`id - bases[r]` in that region's buffers; every buffer
of a region holds the same number of pages). Region numbers are fixed (MAIN, SWA, STATE); a
region a server does not have has no buffers and no pages (its base equals the next one's),
so a model without SWA puts its state slots right after the main pages and one without any
K/V (Mamba2) has only state pages. Each side has its own bases (the pools differ in size);
a Destination's geometry tells the prefill the decode's. A chunk on the wire is from one
region only (`Chunk.region`), in local page ids of that region's buffers.
"""
from __future__ import annotations

from kvstrata.transfer.disagg.messages import BufferGeometry, check_page_buffers

MAIN, SWA, STATE = 0, 1, 2


class PageRegions:
    def __init__(self, buffers, swa_buffers=(), state_buffers=()):
        groups = [list(buffers), list(swa_buffers), list(state_buffers)]
        while len(groups) > 1 and not groups[-1]:
            groups.pop()  # trailing regions this server lacks
        if not any(groups):
            check_page_buffers([])  # the error: nothing to register
        self.groups = [check_page_buffers(g) if g else [] for g in groups]
        self.pages = [int(g[0].shape[1]) if g else 0 for g in self.groups]
        self.bases = bases_of(self.pages)

    @property
    def flat(self) -> list:
        return [b for g in self.groups for b in g]

    def geometry(self) -> list[BufferGeometry]:
        return [BufferGeometry(int(b.shape[0]), int(b.shape[1]), int(b.shape[2]), region)
                for region, g in enumerate(self.groups) for b in g]

    def page_bytes(self, region: int) -> int:
        """Bytes one page of this region takes over its buffers (0: a region it lacks)."""
        if region >= len(self.groups):
            return 0
        return sum(int(b.shape[0]) * int(b.shape[2]) for b in self.groups[region])

    def valid(self, page_id: int) -> bool:
        """A page id a peer may name: not a region's padding page 0, inside its region."""
        region = region_of(page_id, self.bases)
        local = page_id - self.bases[region]
        return 0 < local < self.pages[region]


def bases_of(pages: list[int]) -> list[int]:
    out, base = [], 0
    for n in pages:
        out.append(base)
        base += n
    return out


def geometry_bases(geometry: list[BufferGeometry]) -> list[int]:
    """A peer's region bases from its registered geometry (first buffer of each region; a
    region without buffers has no pages)."""
    first: dict[int, int] = {}
    for g in geometry:
        first.setdefault(g.region, g.num_pages)
    return bases_of([first.get(r, 0) for r in range(max(first, default=0) + 1)])


def region_of(page_id: int, bases: list[int]) -> int:
    """The region of a page id: the last one starting at or below it (a region without
    pages starts where the next one does, so it never owns an id)."""
    region = 0
    for r, base in enumerate(bases):
        if page_id >= base:
            region = r
    return region


def region_count(page_ids: list[int], bases: list[int], region: int) -> int:
    """How many of these page ids are in `region` (0 where the server lacks it)."""
    return sum(1 for p in page_ids if region_of(p, bases) == region) \
        if len(bases) > region else 0


def swa_count(page_ids: list[int], bases: list[int]) -> int:
    """How many of these page ids are in the SWA region (0 without one)."""
    return region_count(page_ids, bases, SWA)


def drop_held_swa(page_ids: list[int], bases: list[int], held: int) -> tuple[list[int], int]:
    """A prefill's page ids without the first `held` SWA-region ones (the decode holds
    those pages of the prompt's last window already); returns (kept, how many dropped)."""
    if len(bases) <= SWA:
        return page_ids, 0
    kept, dropped = [], 0
    for p in page_ids:
        if region_of(p, bases) == SWA and dropped < held:
            dropped += 1
        else:
            kept.append(p)
    return kept, dropped


def split(src: list[int], dst: list[int], src_bases: list[int],
          dst_bases: list[int]) -> list[tuple[int, int, list[int], list[int]]]:
    """(region, first position, local src ids, local dst ids) for each run of positions in one
    region; at least one entry (an empty send still reports). A page whose region differs on
    the two sides is a bookkeeping bug on one of them: ValueError."""
    out: list[tuple[int, int, list[int], list[int]]] = []
    for pos, (s, d) in enumerate(zip(src, dst)):
        region = region_of(s, src_bases)
        if region != region_of(d, dst_bases):
            raise ValueError(f"page #{pos}: source id {s} is in region {region}, destination "
                             f"id {d} in region {region_of(d, dst_bases)}")
        if not out or out[-1][0] != region:
            out.append((region, pos, [], []))
        out[-1][2].append(s - src_bases[region])
        out[-1][3].append(d - dst_bases[region])
    return out or [(MAIN, 0, [], [])]


__all__ = ["MAIN", "STATE", "SWA", "PageRegions", "drop_held_swa", "geometry_bases",
           "region_count", "region_of", "split", "swa_count"]
