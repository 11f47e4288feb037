"""The scheduler's human-readable state snapshot, for stall and watchdog logs (no torch)."""
from __future__ import annotations

from kvstrata.engine.request import Request


def brief(r: Request) -> str:
    return (f"{r.rid}(prompt={len(r.prompt_ids)} out={len(r.output_ids)} "
            f"max_new={r.params.max_new_tokens} computed={r.num_computed_tokens} "
            f"pages={len(r.pages)} tree_pages={r.num_tree_pages} row={r.row} "
            f"retracted={r.retraction_count})")


def dump_state(sched) -> str:
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
    if sched.chunked_req is not None:
        lines.append("chunked: " + brief(sched.chunked_req))
    lines += ["running: " + brief(r) for r in sched.running[:16]]
    lines += ["waiting: " + brief(r) for r in sched.waiting[:16]]
    return "\n".join(lines)
