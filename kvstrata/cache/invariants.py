"""One check over the whole KV bookkeeping (no torch), run by tests after draining and after
every scheduler step when KVSTRATA_CHECK_INTEGRITY=1.

What must hold at any step boundary:
- every device page is exactly one of: free / owned by one live request / owned by the tree
  (same for host pages: free / held by a tree node / being written for a node / HiCache L3:
  a prefetch's buffer, or the copy of a node dropped while a storage backup reads it, see
  cache/storage_tier.py; every node's host_ref equals the backups reading it; in a decode
  server's retraction host pool: free / held by one retracted request's backup, checked by
  KVManager.check_backups from engine/sides/disagg_retract.py);
- a request's tree-owned prefix is exactly the pages on the path to its locked node;
- every node's lock_ref equals the number of lock holders whose path runs through it:
  live requests (their `last_node`) and in-flight HiCache write jobs (the node they pin).
  A lock nobody holds is a leak that makes pages unevictable forever.
"Live requests" here means every request that holds pages, which on a PD server includes
those outside the running batch (Scheduler passes them in): prefill requests whose KV is being
sent (inflight: tree-locked prompt path + the partial last page they own), decode requests in
transfer or transferred and waiting for a row (own pages, no row, no lock), and aborted
requests whose pages a live transfer may still touch (until the room reports its end).
Who takes and drops locks (all through KVManager / the tree, nowhere else):
  match_and_lock (admit)     lock(matched node)          release(...)        unlock
  HiCache load-back          lock(loaded node), unlock(matched node)
  cache_unfinished (chunk)   lock(new node), unlock(old node)
  HiCache write job          lock(node) at submit, unlock when the job finishes or fails
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable


def _path_pages(tree, node) -> list[int]:
    pages: list[list[int]] = []
    while node is not None and node is not tree.root:
        pages.append(node.device_pages)
        node = node.parent
    return [p for chunk in reversed(pages) for p in chunk]


def expected_locks(tree, holders: Iterable[Any]) -> Counter:
    """node id -> number of holders whose path runs through it."""
    expected: Counter = Counter()
    for node in holders:
        while node is not None and node is not tree.root:
            expected[node.id] += 1
            node = node.parent
    return expected


def check_kv_state(kv, live_requests: list[Any]) -> None:
    """Raise AssertionError naming the first broken invariant of `kv` (a KVManager)."""
    tree, alloc = kv.tree, kv.allocator
    kv.check_integrity(live_requests)  # page accounting: free + own + cached == total
    tree_pages = {p for n in tree.nodes() for p in n.device_pages}
    holders = []
    for req in live_requests:
        own = req.pages[req.num_tree_pages:]
        for p in own:
            assert alloc.is_allocated(p), f"{req.rid}: owns page {p} which is free"
            assert p not in tree_pages, f"{req.rid}: owns page {p} which the tree owns"
        if req.last_node is None:
            assert req.num_tree_pages == 0, f"{req.rid}: tree pages without a lock"
            continue
        assert req.last_node.parent is not None or req.last_node is tree.root, (
            f"{req.rid}: its locked node was evicted")
        path = _path_pages(tree, req.last_node)
        assert path == req.pages[:req.num_tree_pages], (
            f"{req.rid}: tree prefix {req.pages[:req.num_tree_pages]} != pages on the path "
            f"to its locked node {path}")
        holders.append(req.last_node)
    if kv.hicache:
        holders += tree.copy_job_locks()
    expected = expected_locks(tree, holders)
    for node in tree.nodes():
        assert node.lock_ref == expected.get(node.id, 0), (
            f"{node!r}: lock_ref {node.lock_ref} but {expected.get(node.id, 0)} live holders "
            f"(requests and copy jobs) pass through it")


def expected_rows(live_requests: list[Any], page_size: int) -> dict[int, list[int]]:
    """row -> slots of the positions whose req_to_token entries must be current now."""
    rows: dict[int, list[int]] = {}
    for req in live_requests:
        if not req.row:
            continue
        assert req.row not in rows, f"row {req.row} given to two live requests"
        upto = min(req.row_stale_from, req.num_computed_tokens)
        rows[req.row] = [req.pages[i // page_size] * page_size + i % page_size
                         for i in range(upto)]
    return rows


def expected_swa_rows(live_requests: list[Any], swa) -> dict[int, tuple[int, list[int]]] | None:
    """Hybrid SWA memory: row -> (first position, SWA slots) of the entries the next query
    of each live request reads in the SWA req_to_token table: its window (positions
    num_computed - W + 1 .. num_computed - 1, current ones only). Older entries may name SWA
    slots freed and reused since: never read, so not checked. None without an SWA pool."""
    if swa is None:
        return None
    rows: dict[int, tuple[int, list[int]]] = {}
    for req in live_requests:
        if not req.row:
            continue
        upto = min(req.row_stale_from, req.num_computed_tokens)
        start = min(max(req.num_computed_tokens - swa.window + 1, 0), upto)
        rows[req.row] = (start, swa.slots(req.pages, start, upto))
    return rows


def expected_state_slots(kv, live_requests: list[Any]) -> dict[int, tuple[int, ...]]:
    """Recurrent state: slot -> the token ids whose state it must hold now (a runner that
    can tell compares): each live request's working slot the tokens it computed, its aside
    slot those up to its snapshot, each cached snapshot its node's path (cache salts taken
    off the tree's ids: salted_ids adds the salt above the token's 32 bits); with HiCache, a
    host copy of a snapshot (key ("host", host slot)) its node's path too, once the runner
    made the copy (not while its op waits for the next step)."""
    out: dict[int, tuple[int, ...]] = {}
    waiting: set = set()
    for op in getattr(kv.tree, "pending_ops", ()):
        if not getattr(op, "state_slots", None):
            continue
        if op.kind == "d2h":
            waiting.update(("host", h) for h in op.host_state_slots)
        else:
            waiting.update(op.state_slots)
    for req in live_requests:
        if req.state_slot:
            out[req.state_slot] = tuple(req.all_ids[:req.num_computed_tokens])
        if req.state_aside_slot:
            out[req.state_aside_slot] = tuple(req.all_ids[:req.state_aside_pos])
    stack = [(child, ()) for child in kv.tree.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        path = prefix + tuple(t & 0xFFFFFFFF for t in node.key)
        if node.state_slot:
            out[node.state_slot] = path
        if node.host_state:
            out[("host", node.host_state)] = path
        stack.extend((child, path) for child in node.children.values())
    return {slot: tokens for slot, tokens in out.items() if slot not in waiting}


def check_backup_pool(kv, held: list[list[int]]) -> None:
    """A decode server's retraction host pool (KVManager.check_backups): free + held by
    backups == total host pages, no page held twice, the manager's count matches."""
    if not kv.backup_pool:
        assert not any(held), "host pages held by a backup without a retraction pool"
        return
    alloc = kv.host_allocator
    alloc.check_integrity()
    flat = [p for pages in held for p in pages]
    assert len(set(flat)) == len(flat), "a host page held by two backups"
    assert set(flat) == kv.backup_pages(), (
        f"backups hold host pages {sorted(flat)}, the KV manager counts "
        f"{sorted(kv.backup_pages())}")
    assert all(alloc.is_allocated(p) for p in flat), "a backup holds a free host page"
    if kv.hicache:
        return  # shared with the tree: its check counts both (HiRadixCache)
    assert alloc.available_pages() + len(flat) == alloc.num_pages, (
        f"host KV page leak: free {alloc.available_pages()} + backed up {len(flat)} != "
        f"total {alloc.num_pages}")
