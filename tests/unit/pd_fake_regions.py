"""A room's page list in the fake PD hubs: the main pool's pages, then another region's (the
SWA pool's, or the state pool's slots) from a base on; each side has its own base
(transfer/disagg/regions.py, cache/swa_pd.py, cache/state_pd.py)."""
from __future__ import annotations


def split_at_base(src_pages: list[int], dst_pages: list[int], src_base: int, dst_base: int
                  ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(main (src, dst) pairs, the other region's in its local ids). A page in one region on
    one side and the other region on the other, or the other region's before a main page,
    is a bookkeeping bug of a scheduler."""
    assert len(src_pages) == len(dst_pages), (src_pages, dst_pages)
    main = [(s, d) for s, d in zip(src_pages, dst_pages) if s < src_base]
    other = [(s - src_base, d - dst_base) for s, d in zip(src_pages, dst_pages) if s >= src_base]
    assert all(d < dst_base for _, d in main) and all(d > 0 for _, d in other), \
        (src_pages, dst_pages)
    assert src_pages[:len(main)] == [s for s, _ in main], f"main pages after others: {src_pages}"
    return main, other
