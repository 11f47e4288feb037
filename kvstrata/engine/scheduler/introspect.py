"""Scheduler introspection (no torch): the whole-state check run after every step under
KVSTRATA_CHECK_INTEGRITY, and the human-readable snapshot for stall and watchdog logs."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.cache.invariants import check_kv_state
from kvstrata.engine.request import Request

if TYPE_CHECKING:  # annotations only: no import circle
    from kvstrata.engine.scheduler.core import Scheduler


def brief(r: Request) -> str:
    return (f"{r.rid}(prompt={len(r.prompt_ids)} out={len(r.output_ids)} "
            f"max_new={r.params.max_new_tokens} computed={r.num_computed_tokens} "
            f"pages={len(r.pages)} tree_pages={r.num_tree_pages} row={r.row} "
            f"retracted={r.retraction_count}"
            + (f" swa_evicted={r.swa_evicted_pages} swa_lock_from={r.swa_lock_from}"
               if r.swa_lock_from is not None or r.swa_evicted_pages else "")
            + (f" state_slot={r.state_slot} aside={r.state_aside_slot}@{r.state_aside_pos}"
               if r.state_slot else "") + ")")


def dump_state(sched: Scheduler) -> str:
    """Queues and KV usage of `sched`."""
    kv = sched.kv
    lines = [
        f"step {sched.step_id}: waiting {len(sched.waiting)}, running {len(sched.running)}, "
        f"chunked {sched.chunked_req.rid if sched.chunked_req else None}",
        f"pages: total {kv.allocator.num_pages}, free {kv.allocator.available_pages()}, "
        f"tree evictable {kv.tree.evictable_pages()}, tree protected "
        f"{kv.tree.protected_pages()}, page_size {sched.page_size}; rows free "
        f"{len(sched.free_rows)}/{sched.num_rows}; transfers in flight "
        f"{kv.has_transfers_in_flight()}; new_token_ratio {sched.ratio.value:.4f}",
    ]
    if kv.swa is not None:
        lines.append(f"SWA pages: total {kv.swa.allocator.num_pages}, free "
                     f"{kv.swa.allocator.available_pages()}, tree evictable "
                     f"{kv.tree.evictable_swa_pages()}, tree protected "
                     f"{kv.tree.protected_swa_pages()}, window {kv.swa.window}")
    if kv.states is not None:
        lines.append(f"state slots: total {kv.states.num_slots}, free "
                     f"{kv.states.allocator.available_pages()}, cached snapshots "
                     f"{kv.tree.cached_states()}, pinned {kv.tree.pinned_states()}")
    if sched.chunked_req is not None:
        lines.append("chunked: " + brief(sched.chunked_req))
    lines += ["running: " + brief(r) for r in sched.running[:16]]
    lines += ["waiting: " + brief(r) for r in sched.waiting[:16]]
    for side in sched.sides:
        lines += side.dump_lines(brief)
    return "\n".join(lines)


def check_scheduler(sched: Scheduler) -> None:
    """KV invariants over every request holding pages (live ones and, on a PD server, those
    in transfer or transferred), rows, and queue membership."""
    live = sched.live_requests()
    held = [r for side in sched.sides for r in side.kv_holders()]
    check_kv_state(sched.kv, live + held)
    rows_in_use = sum(1 for r in live if r.row)
    assert rows_in_use + len(sched.free_rows) == sched.num_rows, "req_to_token row leak"
    assert len(set(sched.free_rows)) == len(sched.free_rows), "a row is free twice"
    assert not ({r.row for r in live} & set(sched.free_rows)), "a live request's row is free"
    for r in sched.waiting:
        assert not r.pages and r.last_node is None and not r.row and not r.state_slot, (
            f"waiting request {r.rid} holds KV")
    assert sched.chunked_req not in sched.running, "chunked request is also running"
    queued = list(sched.waiting)
    for side in sched.sides:
        side.check()
        queued += side.queued()
    ids = [r.rid for r in queued + live]
    assert len(ids) == len(set(ids)), "a request is in two queues"
