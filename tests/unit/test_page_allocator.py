"""PageAllocator: exact page ids, all-or-nothing alloc/free, integrity checks."""
import pytest

from kvstrata.cache.page_allocator import PageAllocator


def make(num_pages=8, page_size=1):
    alloc = PageAllocator(num_pages, page_size)
    alloc.check_integrity()
    return alloc


def test_fresh_allocator_hands_out_lowest_ids_and_never_page_zero():
    a = make(8, page_size=4)
    assert (a.num_pages, a.page_size) == (8, 4)
    assert a.available_pages() == 8 and a.num_used() == 0
    assert a.alloc(3) == [1, 2, 3]
    assert a.alloc(5) == [4, 5, 6, 7, 8]
    assert a.available_pages() == 0 and a.num_used() == 8
    a.check_integrity()


def test_alloc_zero_and_too_many():
    a = make(4)
    assert a.alloc(0) == []
    assert a.alloc(2) == [1, 2]
    # Not enough: None and nothing changes.
    assert a.alloc(3) is None
    assert a.available_pages() == 2 and a.num_used() == 2
    assert a.alloc(2) == [3, 4]
    assert a.alloc(1) is None
    a.check_integrity()


def test_negative_alloc_raises():
    with pytest.raises(ValueError):
        make(4).alloc(-1)


def test_freed_pages_are_reused_lowest_first():
    a = make(8)
    assert a.alloc(5) == [1, 2, 3, 4, 5]
    a.free([4, 2])
    a.check_integrity()
    assert a.available_pages() == 5
    assert a.alloc(3) == [2, 4, 6]
    a.free([1, 6, 5])
    assert a.alloc(4) == [1, 5, 6, 7]
    a.check_integrity()


def test_free_rejects_bad_pages_and_changes_nothing():
    a = make(4)
    assert a.alloc(2) == [1, 2]
    bad_calls = [
        [0],        # padding sink
        [5],        # out of range
        [-1],       # out of range
        [3],        # never allocated
        [1, 1],     # twice in one call
        [1, 3],     # second id bad: the first must not be freed either
    ]
    for pages in bad_calls:
        with pytest.raises(ValueError):
            a.free(pages)
        assert a.available_pages() == 2 and a.num_used() == 2, pages
        a.check_integrity()
    a.free([1])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([1])  # double free
    assert a.alloc(3) == [1, 3, 4]


def test_free_empty_list_is_a_no_op():
    a = make(2)
    a.free([])
    assert a.available_pages() == 2


def test_zero_pages():
    a = make(0)
    assert a.available_pages() == 0
    assert a.alloc(0) == []
    assert a.alloc(1) is None
    a.check_integrity()


def test_reset_frees_everything():
    a = make(3)
    a.alloc(3)
    a.reset()
    assert a.available_pages() == 3 and a.num_used() == 0
    assert a.alloc(1) == [1]
    a.check_integrity()


def test_check_integrity_detects_corruption():
    a = make(4)
    a.alloc(2)
    a._used.add(3)  # page 3 now both free and used
    with pytest.raises(AssertionError, match="both free and used"):
        a.check_integrity()

    b = make(4)
    b.alloc(2)
    b._used.discard(2)  # page 2 leaked: neither free nor used
    with pytest.raises(AssertionError, match="missing: \\[2\\]"):
        b.check_integrity()

    c = make(4)
    c.free(c.alloc(2)[:1])
    c._free_heap.append(1)  # heap holds page 1 twice
    with pytest.raises(AssertionError, match="twice"):
        c.check_integrity()

    d = make(4)
    d.alloc(1)
    d._free_heap.append(3)  # page 3 was never handed out: it is free already
    d._free_set.add(3)
    with pytest.raises(AssertionError, match="free twice"):
        d.check_integrity()


def test_pages_given_back_come_before_never_used_ones():
    a = make(8)
    first = a.alloc(5)
    assert first == [1, 2, 3, 4, 5]
    a.free([4, 2])
    assert a.available_pages() == 5
    assert a.alloc(4) == [2, 4, 6, 7]
    a.check_integrity()
    assert a.alloc(2) is None and a.available_pages() == 1
    assert a.alloc(1) == [8]
    a.free([1, 8, 6])
    assert a.alloc(3) == [1, 6, 8]
    a.check_integrity()


def test_a_huge_pool_starts_at_once():
    """A default-sized CPU pool has millions of pages: building them as a list cost over a
    second of every server start."""
    import tracemalloc
    tracemalloc.start()
    try:
        a = make(1 << 26)
        assert a.available_pages() == 1 << 26
        assert a.alloc(3) == [1, 2, 3]
        a.check_integrity()
        assert tracemalloc.get_traced_memory()[1] < 1 << 20  # no per-page container
    finally:
        tracemalloc.stop()


def test_invalid_construction():
    with pytest.raises(ValueError):
        PageAllocator(-1, 1)
    # page_size is validated once, in config/ (ServerArgs, KVPlan): the pools trust the plan.


def test_large_pool_check_is_cheap_and_still_catches_leaks_and_double_ownership():
    """A default-sized pool has millions of pages and the check runs after every step: once
    more than FULL_CHECK_PAGES were handed out it costs O(pages in use), and still finds a
    leak or a page both free and used."""
    from kvstrata.cache.page_allocator import FULL_CHECK_PAGES
    alloc = PageAllocator(FULL_CHECK_PAGES * 4, 1)
    alloc.free(alloc.alloc(FULL_CHECK_PAGES + 20)[10:])
    pages = alloc.alloc(10)
    alloc.check_integrity()
    alloc._used.discard(pages[0])  # leaked: neither free nor used
    with pytest.raises(AssertionError, match="num_pages"):
        alloc.check_integrity()
    alloc._used.add(pages[0])
    alloc._free_set.add(pages[1])  # both free and used
    alloc._free_heap.append(pages[1])
    with pytest.raises(AssertionError, match="free or out of range"):
        alloc.check_integrity()
