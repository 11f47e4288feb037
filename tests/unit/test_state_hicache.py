"""HiCache L2 with state snapshots (cache/state_hiradix.py), torch-free and with exact ids:
which ops move a snapshot when its device copy goes, how a match ends at a host-only
snapshot and loads it, what host state slot pressure drops, and a model without K/V
(Mamba2) writing page ids with a snapshot at a state eviction. The randomised versions are
test_state_fuzz.py and test_scheduler_fuzz.py (a host tier beside a state pool)."""
from __future__ import annotations

import pytest

from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.state_hiradix import StateHiRadixCache, resume_at_state
from tests.unit.test_state_cache import chat_hit_rate


def tree(host_slots: int = 2, write_policy: str = "write_back", slots: int = 3,
         pages_hold_kv: bool = True):
    return StateHiRadixCache(PageAllocator(8, 1), 1, PageAllocator(16, 1),
                             PageAllocator(slots, 1), PageAllocator(host_slots, 1),
                             write_policy, pages_hold_kv=pages_hold_kv)


def cache(t: StateHiRadixCache, ids: list[int]):
    """Insert `ids` (fresh device pages) and file a fresh snapshot at their end."""
    t.insert(ids, t.allocator.alloc(len(ids)))
    node = t.node_at(ids)
    assert t.attach_state(node, t.slots.alloc(1)[0])
    return node


def state_ops(t: StateHiRadixCache):
    ops, t.pending_ops = t.pending_ops, []
    return [(op.kind, op.state_slots, op.host_state_slots) for op in ops if op.state_slots]


def test_demotion_writes_the_snapshot_and_a_hit_loads_it_back():
    t = tree()
    a = cache(t, [1, 2, 3])
    assert a.state_slot == 1
    assert t.evict(3) == 3  # write_back: pages and snapshot to the host, sync
    assert state_ops(t) == [("d2h", [1], [1])]
    assert (a.device_pages, a.state_slot, a.host_state) == ([], 0, 1)
    t.check_integrity()
    match = t.match_prefix([1, 2, 3, 4])
    assert match.host_pages and match.last_host_node is a  # ends at the host snapshot
    node = t.load_back(match, t.allocator.alloc(len(match.host_pages)))
    t.lock(node)
    match.last_node, match.device_pages = node, node.device_pages
    assert resume_at_state(t, match) is match and a.state_slot == 1
    assert state_ops(t) == [("h2d", [1], [1])]
    t.check_integrity()
    t.unlock(node)
    assert t.states_to_host == t.states_from_host == 1


def test_state_eviction_keeps_a_host_copy_and_the_kv():
    t = tree(write_policy="write_through")
    a = cache(t, [1, 2])
    t.pending_ops = []
    t.on_transfer_done(next(iter(t._jobs)), True)  # the page write ended: host pages
    assert t.evict_states(1) == 1
    assert state_ops(t) == [("d2h", [1], [1])]
    assert (a.state_slot, a.host_state, len(a.device_pages)) == (0, 1, 2)
    assert t.peek_device_pages([1, 2, 9]) == 0  # no device snapshot ...
    match = t.match_prefix([1, 2, 9])
    assert match.last_node is a and not match.host_pages  # ... but a host one to load
    t.lock(a)
    resume_at_state(t, match)
    assert a.state_slot and state_ops(t) == [("h2d", [a.state_slot], [1])]
    t.unlock(a)
    t.check_integrity()


@pytest.mark.parametrize("pages_hold_kv", [True, False])
def test_a_state_eviction_under_write_back_writes_page_ids_only_without_kv(pages_hold_kv):
    """write_back gives a node host pages only when the device evicts it: a state eviction
    of a hybrid's node drops its snapshot (nothing on the host to resume with). A model
    without K/V (Mamba2) writes the node's page ids first (a sync page op that moves no
    bytes), then the snapshot, so the match still ends there, at the host copy."""
    t = tree(pages_hold_kv=pages_hold_kv)
    a = cache(t, [1, 2])
    assert t.evict_states(1) == 1
    ops, t.pending_ops = t.pending_ops, []
    if pages_hold_kv:
        assert ops == [] and (a.host_pages, a.host_state) == (None, 0)
        assert t.match_prefix([1, 2, 9]).last_node is t.root
    else:
        assert [(op.kind, op.device_pages, op.host_pages, op.sync, op.state_slots,
                 op.host_state_slots) for op in ops] == [
            ("d2h", [1, 2], [1, 2], True, [], []), ("d2h", [], [], True, [1], [1])]
        assert (a.host_pages, a.host_state, a.state_slot) == ([1, 2], 1, 0)
        assert t.match_prefix([1, 2, 9]).last_node is a
    t.check_integrity()


def test_host_slot_pressure_drops_the_oldest_host_copy_and_cuts_its_match():
    t = tree(host_slots=1)
    a = cache(t, [1, 2])
    b = cache(t, [5, 6])
    t.evict(4)  # both demoted, one host state slot: a's copy goes for b's
    assert state_ops(t) == [("d2h", [1], [1]), ("d2h", [2], [1])]
    assert (a.host_state, b.host_state) == (0, 1) and a.host_pages and b.host_pages
    t.check_integrity()
    assert t.match_prefix([1, 2, 3]).last_node is t.root  # K/V on the host, no state
    assert t.match_prefix([5, 6, 7]).last_host_node is b


def test_a_match_without_a_device_slot_is_cut_back_to_a_device_snapshot():
    t = tree(slots=2)
    a = cache(t, [1, 2])
    b = cache(t, [1, 2, 3, 4])
    t.pending_ops = []
    t.evict(2)  # b's pages and snapshot demoted
    t.pin_state(a)
    t.lock(a)
    t.slots.alloc(1)  # the last free slot taken elsewhere; a's is pinned
    match = t.match_prefix([1, 2, 3, 4, 5])
    assert match.last_host_node is b
    node = t.load_back(match, t.allocator.alloc(2))
    t.lock(node)
    match.last_node, match.device_pages = node, a.device_pages + node.device_pages
    assert b.host_state and not t.load_state(b)
    resume_at_state(t, match)
    assert match.last_node is a and match.device_pages == a.device_pages
    t.unlock(a)
    t.unpin_state(a)
    t.unlock(a)
    t.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_host_tier_brings_back_the_multi_turn_hits_a_small_device_pool_loses(page_size):
    """test_state_cache's six chats of five turns over a 512-token device pool, which holds
    about two histories: without a host tier most earlier turns are evicted before their
    next one; with 8x host pages and 96 host state slots they come back from the host, as
    often as from a device pool of 4096 tokens (measured: page size 1: 0.187 -> 0.827,
    page size 16: 0.194 -> 0.727, the roomy device pool's 0.827 / 0.727)."""
    cold = chat_hit_rate(page_size, state=True, pool_tokens=512)
    host = chat_hit_rate(page_size, state=True, pool_tokens=512, host=(4096 // page_size, 96))
    roomy = chat_hit_rate(page_size, state=True)
    print(f"page size {page_size}: device only {cold:.3f}, with host {host:.3f}, "
          f"roomy device {roomy:.3f}")
    assert host >= 0.95 * roomy and host > 2 * cold, (cold, host, roomy)
