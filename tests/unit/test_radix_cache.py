"""RadixCache: exact page ids, split behaviour, duplicate pages, locks, eviction order, disabled
mode. Every public operation runs check_integrity (see CheckedRadixCache)."""
import random

import pytest

from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.radix_cache import RadixCache


class CheckedRadixCache(RadixCache):
    """Runs the full integrity check after every public operation (wrapped below)."""


def _checked(name):
    def method(self, *args):
        result = getattr(RadixCache, name)(self, *args)
        self.check_integrity()
        return result
    return method


for _name in ("match_prefix", "insert", "lock", "unlock", "evict", "reset"):
    setattr(CheckedRadixCache, _name, _checked(_name))


def make(num_pages=16, page_size=1, **kwargs):
    alloc = PageAllocator(num_pages, page_size)
    cache = CheckedRadixCache(alloc, page_size, **kwargs)
    cache.check_integrity()
    return cache, alloc


def put(cache, alloc, tokens):
    """A finished request with only fresh pages: every page in [0, k) is a duplicate it frees."""
    pages = alloc.alloc(len(tokens) // cache.page_size)
    k = cache.insert(tokens, pages)
    alloc.free(pages[:k])
    return k


def tree(cache, node=None):
    """The tree as nested {key: (pages, children)} for exact structural assertions."""
    node = node or cache.root
    return {c.key: (c.device_pages, tree(cache, c)) for c in node.children.values()}


def allocated(alloc):
    return {p for p in range(1, alloc.num_pages + 1) if alloc.is_allocated(p)}


def evict_one_by_one(cache, alloc):
    """evict(1) until nothing is left; returns the pages freed by each call, in order."""
    order = []
    while True:
        before = allocated(alloc)
        freed = cache.evict(1)
        if freed == 0:
            return order
        gone = sorted(before - allocated(alloc))
        assert len(gone) == freed
        order.append(gone)


# --- match / split
def test_match_splits_node_where_the_match_ends():
    cache, alloc = make()
    assert cache.hit_rate() == 0.0
    m = cache.match_prefix([1, 2, 3])
    assert m.device_pages == [] and m.last_node is cache.root  # empty tree
    assert alloc.alloc(3) == [1, 2, 3]
    assert cache.insert([10, 11, 12], [1, 2, 3]) == 0
    assert tree(cache) == {(10, 11, 12): ([1, 2, 3], {})}
    assert (cache.cached_pages(), cache.evictable_pages(), cache.protected_pages()) == (3, 3, 0)
    m = cache.match_prefix([10, 11, 12])
    assert m.device_pages == [1, 2, 3] and m.last_node.key == (10, 11, 12)
    assert cache.match_prefix([10, 11, 12, 13]).device_pages == [1, 2, 3]
    assert tree(cache) == {(10, 11, 12): ([1, 2, 3], {})}  # full matches never split
    m = cache.match_prefix([10, 11])
    assert m.device_pages == [1, 2] and m.last_node.key == (10, 11)
    assert tree(cache) == {(10, 11): ([1, 2], {(12,): ([3], {})})}
    m = cache.match_prefix([10, 99, 12])
    assert m.device_pages == [1] and m.last_node.key == (10,)
    assert tree(cache) == {(10,): ([1], {(11,): ([2], {(12,): ([3], {})})})}
    m = cache.match_prefix([99])
    assert m.device_pages == [] and m.last_node is cache.root
    assert cache.cached_pages() == 3 and alloc.available_pages() == 13
    # Hit-rate stats: 6 queries above, 16 tokens asked, 0 + 3 + 3 + 2 + 1 + 0 matched.
    assert (cache.total_matched_tokens, cache.total_queried_tokens, cache.hit_rate()) == (9, 16, 9 / 16)


def test_insert_returns_pages_already_cached_and_adopts_the_rest():
    cache, alloc = make()
    assert put(cache, alloc, [10, 11, 12]) == 0  # pages [1, 2, 3]
    own = alloc.alloc(5)
    assert own == [4, 5, 6, 7, 8]
    # The tree already has 3 pages of this key: own[:3] are duplicates for the caller to free,
    # own[3:] = [7, 8] are adopted.
    assert cache.insert([10, 11, 12, 13, 14], own) == 3
    alloc.free(own[:3])
    assert tree(cache) == {(10, 11, 12): ([1, 2, 3], {(13, 14): ([7, 8], {})})}
    assert cache.match_prefix([10, 11, 12, 13, 14]).device_pages == [1, 2, 3, 7, 8]
    assert cache.cached_pages() == 5 and alloc.num_used() == 5
    # Fully present: nothing adopted, every page is a duplicate.
    own = alloc.alloc(5)
    assert own == [4, 5, 6, 9, 10]
    assert cache.insert([10, 11, 12, 13, 14], own) == 5
    alloc.free(own)
    assert cache.cached_pages() == 5 and alloc.num_used() == 5
    assert cache.insert([], []) == 0
    with pytest.raises(ValueError, match="padding sink"):
        cache.insert([1], [0])
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert([1, 2], [1])


def test_insert_with_the_matched_prefix_frees_only_the_callers_pages():
    # The scheduler flow: match + lock, compute the rest, insert prefix + own pages.
    cache, alloc = make()
    put(cache, alloc, [1, 2])  # pages [1, 2]
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.last_node)
    own = alloc.alloc(2)
    assert own == [3, 4]
    pages = m.device_pages + own  # [1, 2] are the tree's own ids
    assert cache.insert([1, 2, 3, 4], pages) == 2  # == len(m.device_pages): no duplicates
    cache.unlock(m.last_node)
    assert tree(cache) == {(1, 2): ([1, 2], {(3, 4): ([3, 4], {})})}
    assert (cache.evictable_pages(), cache.protected_pages()) == (4, 0)


def test_insert_diverging_inside_a_node_splits_it():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])  # pages [1, 2, 3, 4]
    own = alloc.alloc(4)
    assert own == [5, 6, 7, 8]
    assert cache.insert([1, 2, 9, 9], own) == 2
    alloc.free(own[:2])
    assert tree(cache) == {(1, 2): ([1, 2], {(3, 4): ([3, 4], {}), (9, 9): ([7, 8], {})})}
    # A key that simply ends inside a node needs no split.
    assert put(cache, alloc, [1, 2, 9]) == 3
    assert tree(cache) == {(1, 2): ([1, 2], {(3, 4): ([3, 4], {}), (9, 9): ([7, 8], {})})}
    assert alloc.num_used() == 6


def test_page_size_4_matches_whole_pages_only():
    cache, alloc = make(page_size=4)
    tokens = list(range(100, 112))  # 3 pages
    assert put(cache, alloc, tokens) == 0
    assert tree(cache) == {tuple(tokens): ([1, 2, 3], {})}
    assert cache.match_prefix(tokens[:3]).device_pages == []  # less than one page
    m = cache.match_prefix(tokens[:10])  # the partial third page is dropped
    assert m.device_pages == [1, 2] and m.last_node.key == tuple(tokens[:8])
    assert tree(cache) == {tuple(tokens[:8]): ([1, 2], {tuple(tokens[8:]): ([3], {})})}
    # Mismatch inside the second page: only the first page matches.
    m = cache.match_prefix(tokens[:6] + [999, 998])
    assert m.device_pages == [1]
    assert tree(cache) == {
        (100, 101, 102, 103): ([1], {(104, 105, 106, 107): ([2], {(108, 109, 110, 111): ([3], {})})})
    }
    # A sibling whose first page shares two tokens with (104..107): children are keyed by the
    # whole first page, so both live under (100..103).
    own = alloc.alloc(2)
    assert own == [4, 5]
    assert cache.insert(tokens[:4] + [104, 105, 777, 778], own) == 1
    alloc.free(own[:1])
    first = cache.root.children[(100, 101, 102, 103)]
    assert sorted(first.children) == [(104, 105, 106, 107), (104, 105, 777, 778)]
    assert first.children[(104, 105, 777, 778)].device_pages == [5]
    assert cache.match_prefix(tokens[:4] + [104, 105, 777, 778, 1]).device_pages == [1, 5]
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert(tokens[:5], [6])


# --- eviction
def test_lru_evicts_least_recently_used_leaf_first():
    cache, alloc = make()
    put(cache, alloc, [1, 2])  # pages [1, 2]
    put(cache, alloc, [3, 4])  # pages [3, 4]
    put(cache, alloc, [5, 6])  # pages [5, 6]
    cache.match_prefix([1, 2])  # A is now the most recent
    assert cache.evict(1) == 2  # whole leaves: B's two pages
    assert tree(cache) == {(1, 2): ([1, 2], {}), (5, 6): ([5, 6], {})}
    assert evict_one_by_one(cache, alloc) == [[5, 6], [1, 2]]
    assert cache.evict(1) == 0 and cache.cached_pages() == 0 and alloc.available_pages() == 16


def test_parent_becomes_evictable_when_its_children_are_gone():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])  # pages [1, 2, 3]
    assert put(cache, alloc, [1, 2, 4]) == 2  # adopts page 6; pages 4, 5 freed
    put(cache, alloc, [7])  # page 4 (lowest free)
    assert tree(cache) == {(1, 2): ([1, 2], {(3,): ([3], {}), (4,): ([6], {})}), (7,): ([4], {})}
    # (3,) is oldest; after (4,) goes, (1, 2) (stamped by the second insert) is older than (7,).
    assert evict_one_by_one(cache, alloc) == [[3], [6], [1, 2], [4]]


def test_evict_frees_at_least_the_request_and_stops():
    cache, alloc = make()
    assert cache.evict(0) == 0 and cache.evict(5) == 0  # empty tree
    put(cache, alloc, [1, 2, 3])  # pages [1, 2, 3]
    put(cache, alloc, [4])  # page 4
    put(cache, alloc, [5, 6])  # pages [5, 6]
    assert cache.evict(0) == 0 and cache.evict(-3) == 0 and cache.cached_pages() == 6
    assert cache.evict(4) == 4  # [1, 2, 3] then [4]
    assert tree(cache) == {(5, 6): ([5, 6], {})}
    assert cache.evict(100) == 2
    assert cache.cached_pages() == 0


@pytest.mark.parametrize("policy,expected", [
    # Stamps: A t1, B t2, C t3, D t4; A matched at t5..t7 (3 hits), B at t8 (1 hit).
    ("lru", [[3], [4], [1], [2]]),  # oldest stamp first: C, D, A, B
    ("lfu", [[3], [4], [2], [1]]),  # fewest hits first, ties by stamp: C, D, B, A
])
def test_eviction_policy_order(policy, expected):
    cache, alloc = make(eviction_policy=policy)
    for token in (1, 2, 3, 4):  # A..D, pages 1..4
        put(cache, alloc, [token])
    for _ in range(3):
        cache.match_prefix([1])
    cache.match_prefix([2])
    assert evict_one_by_one(cache, alloc) == expected


@pytest.mark.parametrize("policy,expected", [
    ("lru", [[2], [1], [3]]),  # (2,) t4, then upper (1,) t5 before (7,) t7
    ("lfu", [[2], [3], [1]]),  # (2,) 2 hits, (7,) 2 hits but newer, then upper (1,) 3 hits
])
def test_split_halves_keep_access_stats(policy, expected):
    cache, alloc = make(eviction_policy=policy)
    put(cache, alloc, [1, 2])  # pages [1, 2], t1
    put(cache, alloc, [7])  # page 3, t2
    cache.match_prefix([1, 2])  # t3
    cache.match_prefix([1, 2])  # t4: 2 hits
    m = cache.match_prefix([1])  # t5: split; the upper half inherits 2 hits and gets a third
    assert (m.last_node.hit_count, m.last_node.last_access_time) == (3, 5)
    lower = m.last_node.children[(2,)]
    assert (lower.hit_count, lower.last_access_time) == (2, 4)
    cache.match_prefix([7])  # t6
    cache.match_prefix([7])  # t7: 2 hits
    assert evict_one_by_one(cache, alloc) == expected


def test_unknown_policy_and_page_size_mismatch():
    with pytest.raises(ValueError, match="eviction policy"):
        RadixCache(PageAllocator(4, 1), 1, eviction_policy="fifo")
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(PageAllocator(4, 2), 1)


# --- locks
def test_lock_protects_path_and_survives_split():
    cache, alloc = make()
    cache.lock(cache.root)  # root: no-op both ways
    cache.unlock(cache.root)
    assert cache.root.lock_ref == 1 and cache.protected_pages() == 0
    put(cache, alloc, [1, 2, 3])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.last_node)
    assert (cache.evictable_pages(), cache.protected_pages()) == (0, 3)
    assert cache.evict(10) == 0
    # Splitting a locked node: the upper half inherits the lock.
    short = cache.match_prefix([1, 2])
    assert short.last_node.lock_ref == 1 and m.last_node.lock_ref == 1
    assert (cache.evictable_pages(), cache.protected_pages()) == (0, 3)
    cache.unlock(m.last_node)  # walks through the new upper node too
    assert short.last_node.lock_ref == 0 and m.last_node.lock_ref == 0
    assert (cache.evictable_pages(), cache.protected_pages()) == (3, 0)
    with pytest.raises(ValueError, match="unlock"):
        cache.unlock(m.last_node)
    assert (cache.evictable_pages(), cache.protected_pages()) == (3, 0)


def test_locked_branch_pins_ancestors_only():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])  # (1, 2)[1, 2] -> (3,)[3]
    put(cache, alloc, [1, 2, 4])  # -> (4,)[6]
    m = cache.match_prefix([1, 2, 4])
    cache.lock(m.last_node)
    cache.lock(m.last_node)  # two requests share the prefix
    assert (cache.evictable_pages(), cache.protected_pages()) == (1, 3)
    assert cache.evict(10) == 1  # only (3,) is evictable
    assert tree(cache) == {(1, 2): ([1, 2], {(4,): ([6], {})})}
    cache.unlock(m.last_node)
    assert cache.evict(10) == 0  # still held by the second lock
    cache.unlock(m.last_node)
    assert cache.evict(10) == 3 and cache.cached_pages() == 0


def test_insert_below_a_locked_node_adds_an_unlocked_leaf():
    cache, alloc = make()
    put(cache, alloc, [1, 2])
    m = cache.match_prefix([1, 2])
    cache.lock(m.last_node)
    put(cache, alloc, [1, 2, 3])  # page 3 adopted
    assert (cache.evictable_pages(), cache.protected_pages()) == (1, 2)
    assert cache.evict(5) == 1
    cache.unlock(m.last_node)
    assert cache.evictable_pages() == 2


# --- reset / disabled / stats
def test_reset_refuses_while_locked_then_frees_everything():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [4])
    m = cache.match_prefix([4])
    cache.lock(m.last_node)
    assert cache.reset() is False
    assert cache.cached_pages() == 4 and alloc.num_used() == 4
    cache.unlock(m.last_node)
    assert cache.reset() is True
    assert cache.cached_pages() == 0 and alloc.available_pages() == 16
    assert tree(cache) == {} and cache.match_prefix([1, 2, 3]).device_pages == []
    assert put(cache, alloc, [1]) == 0 and tree(cache) == {(1,): ([1], {})}
    # Hit-rate counters are cumulative (metrics), so the flush kept them: 2 queries above.
    assert (cache.total_matched_tokens, cache.total_queried_tokens) == (1, 4)


def test_disabled_cache_keeps_nothing():
    cache, alloc = make(disable=True)
    m = cache.match_prefix([1, 2, 3])
    assert m.device_pages == [] and m.last_node is cache.root
    cache.lock(m.last_node)
    pages = alloc.alloc(3)
    # Nothing adopted and 0 returned: the caller frees ALL its pages.
    assert cache.insert([1, 2, 3], pages) == 0
    alloc.free(pages)
    cache.unlock(m.last_node)
    assert cache.match_prefix([1, 2, 3]).device_pages == []
    assert (cache.cached_pages(), cache.evictable_pages(), cache.protected_pages()) == (0, 0, 0)
    assert cache.evict(5) == 0 and cache.reset() is True
    assert alloc.available_pages() == 16
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert([1, 2], [1])


# --- randomised model check
@pytest.mark.parametrize("page_size", [1, 4])
def test_random_operations_agree_with_a_prefix_map(page_size):
    """Model: {token prefix ending at a page boundary: page id}. Matches must follow the model,
    evictions remove exactly the freed pages, locked prefixes survive."""
    rng = random.Random(1234 + page_size)
    cache, alloc = make(num_pages=40, page_size=page_size, eviction_policy=rng.choice(["lru", "lfu"]))
    model: dict[tuple, int] = {}
    held = []  # (tokens, MatchResult) of locked matches
    bases = [[rng.randrange(3) for _ in range(6 * page_size)] for _ in range(3)]
    def sequence():  # a cut of a shared base plus a random tail: lots of partial sharing
        base = rng.choice(bases)[:rng.randrange(6 * page_size + 1)]
        return base + [rng.randrange(3) for _ in range(rng.randrange(3 * page_size))]
    def expected_pages(tokens):
        out = []
        while (len(out) + 1) * page_size <= len(tokens):
            page = model.get(tuple(tokens[:(len(out) + 1) * page_size]))
            if page is None:
                break
            out.append(page)
        return out
    for _ in range(400):
        op = rng.random()
        tokens = sequence()
        if op < 0.35:  # a request finishes: insert whole pages
            whole = tokens[:len(tokens) // page_size * page_size]
            n = len(whole) // page_size
            if alloc.available_pages() < n:
                cache.evict(n - alloc.available_pages())  # the model follows the allocator
                model = {key: page for key, page in model.items() if alloc.is_allocated(page)}
            if alloc.available_pages() < n:
                continue
            own = alloc.alloc(n)
            k = cache.insert(whole, own)
            assert k == len(expected_pages(whole))
            alloc.free(own[:k])
            for i in range(k, n):
                model[tuple(whole[:(i + 1) * page_size])] = own[i]
        elif op < 0.65:
            m = cache.match_prefix(tokens)
            assert m.device_pages == expected_pages(tokens)
            if rng.random() < 0.3:
                cache.lock(m.last_node)
                held.append((tokens, m))
        elif op < 0.8 and held:
            _, m = held.pop(rng.randrange(len(held)))
            cache.unlock(m.last_node)
        else:
            want = rng.randrange(6)
            evictable = cache.evictable_pages()
            before = allocated(alloc)
            freed = cache.evict(want)
            gone = before - allocated(alloc)
            assert len(gone) == freed
            assert freed >= want if evictable >= want else freed == evictable
            model = {key: page for key, page in model.items() if page not in gone}
        for held_tokens, m in held:  # locked prefixes are never evicted
            assert expected_pages(held_tokens)[:len(m.device_pages)] == m.device_pages
        assert cache.cached_pages() == len(model) == alloc.num_used()




def test_peek_device_pages_agrees_with_match_and_has_no_side_effects():
    from kvstrata.cache.page_allocator import PageAllocator
    from kvstrata.cache.radix_cache import RadixCache

    alloc = PageAllocator(32, 2)
    tree = RadixCache(alloc, 2)
    tree.insert([1, 2, 3, 4, 5, 6], alloc.alloc(3))

    def state():
        return ([(n.id, n.last_access_time, n.hit_count, len(n.key)) for n in tree.nodes()],
                tree.total_queried_tokens, tree.total_matched_tokens)

    queries = {(1, 2, 3, 4, 5, 6, 7): 3, (1, 2, 3, 4, 8): 2, (1, 2, 3): 1, (1, 3): 0, (): 0}
    before = state()
    for ids, want in queries.items():
        assert tree.peek_device_pages(list(ids)) == want, ids
    assert state() == before  # no split, no stamp, no hit count, no stats
    for ids, want in queries.items():  # the same answers as a real match
        assert len(tree.match_prefix(list(ids)).device_pages) == want, ids
    assert RadixCache(alloc, 2, disable=True).peek_device_pages([1, 2]) == 0


@pytest.mark.parametrize("hicache", [False, True])
def test_integrity_check_catches_broken_parent_pointers_and_child_locks(hicache):
    """The HiCache tree runs the base tree's structural checks too (it once re-implemented
    the page checks and skipped these)."""
    from kvstrata.cache.hiradix_cache import HiRadixCache

    alloc = PageAllocator(16, 1)
    if hicache:
        cache = HiRadixCache(alloc, 1, PageAllocator(32, 1))
    else:
        cache = RadixCache(alloc, 1)
    for tokens in ([1, 2, 3, 4], [1, 2, 9, 9]):
        pages = alloc.alloc(len(tokens))
        alloc.free(pages[:cache.insert(tokens, pages)])
    cache.check_integrity()
    parent = cache.root.children[(1,)] if (1,) in cache.root.children else \
        next(iter(cache.root.children.values()))
    child = next(iter(parent.children.values()))
    child.parent = cache.root
    with pytest.raises(AssertionError, match="wrong parent pointer"):
        cache.check_integrity()
    child.parent = parent
    cache.check_integrity()
    child.lock_ref += 1  # a lock that did not walk up to its parent
    with pytest.raises(AssertionError, match="lock_ref below its children's sum|counters"):
        cache.check_integrity()
