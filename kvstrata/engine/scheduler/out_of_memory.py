"""What the scheduler core does when memory runs out (no torch): retract for the decode batch,
and the progress guarantee's abort of a request that can never fit. Functions over the
scheduler (its own helpers, not a side: they manage its queues)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvstrata.engine.request import Request
from kvstrata.engine.scheduler.introspect import dump_state
from kvstrata.engine.scheduler.new_token_ratio import RETRACT_DECODE_STEPS
from kvstrata.engine.scheduler.prefill_adder import prefill_candidates
from kvstrata.protocol import FinishReason

if TYPE_CHECKING:  # annotations only: no import circle
    from kvstrata.engine.scheduler.core import Scheduler

logger = logging.getLogger(__name__)

OOM_LAST_REQUEST_MESSAGE = (
    "Out of memory even after retracting all other requests in the decode batch."
)


def stalled(sched: Scheduler) -> bool:
    """Work is waiting, yet this step computes nothing, ends nothing and waits for no copy.
    With requests running, decode always runs (or retracts/aborts), so a stall means
    nothing runs and the head of the queue (or the chunked request) cannot get its pages
    even with every cached page evicted: it can never fit (abort_unfittable)."""
    return bool((sched.waiting or sched.chunked_req is not None)
                and not sched.finished_outside_step
                and not sched.kv.has_transfers_in_flight()
                and not any(side.frees_memory_later() for side in sched.sides))


def retract_for_decode(sched: Scheduler) -> None:
    """Free memory for the decode batch: the chunked request first (it has not reached
    decode, and its computed pages stay in the tree as evictable cache), then running
    requests, fewest generated tokens first, ties: longest prompt. The last running request
    is never retracted; if it still cannot grow it is aborted (SGLang, 500). Retracted
    requests go back to the waiting queue and are recomputed later."""
    kv = sched.kv
    retracted: list[Request] = []
    if sched.chunked_req is not None:
        victim, sched.chunked_req = sched.chunked_req, None
        sched.retract_one(victim)
        retracted.append(victim)
    # Sorted so that pop() yields the fewest generated tokens first, ties: longest prompt.
    remaining = sorted(sched.running,
                       key=lambda r: (len(r.output_ids), -len(r.prompt_ids)), reverse=True)
    while len(remaining) > 1 and not kv.ensure_free_pages(sched.decode_pages_needed(remaining)):
        victim = remaining.pop()
        sched.retract_one(victim)
        retracted.append(victim)
    if not kv.ensure_free_pages(sched.decode_pages_needed(remaining)):
        last = remaining.pop()
        sched.finish_outside_step(last, FinishReason(
            type="abort", message=OOM_LAST_REQUEST_MESSAGE, status_code=500))
    # Make room for the survivors' next few steps right away.
    need_tokens = len(remaining) * RETRACT_DECODE_STEPS
    kv.ensure_free_pages(-(-need_tokens // sched.page_size))
    sched.running = [r for r in sched.running if r in remaining]
    sched.waiting.extend(retracted)
    sched.count_retractions(len(retracted), remaining)


def abort_unfittable(sched: Scheduler) -> None:
    """The progress guarantee: a step that computes nothing while work waits aborts the
    request that cannot fit alone (clear error, no silent spin); anything else is a
    scheduler bug and fails fast with the state."""
    sched.num_stalls += 1
    logger.warning("Scheduler made no progress; aborting the request that cannot fit "
                   "alone. State:\n%s", dump_state(sched))
    if sched.running:
        raise RuntimeError("scheduler stalled with running requests:\n" + dump_state(sched))
    if sched.chunked_req is not None:
        victim, sched.chunked_req = sched.chunked_req, None
    else:
        victim = prefill_candidates(sched)[0]
        sched.waiting.remove(victim)
    need = victim.seq_len + min(victim.remaining_new_tokens(), 1)
    swa = sched.kv.swa
    held = "" if swa is None else (
        f" (its sliding-window pool {swa.allocator.num_pages * sched.page_size}, of which a "
        f"request needs about {swa.per_request_tokens} beyond the chunk it computes)")
    message = (f"Out of memory: the request needs about {need} KV tokens but the pool holds "
               f"{sched.kv.total_tokens}{held} and not enough can be freed; raise "
               f"--max-total-tokens or send a shorter request.")
    # A prompt that cannot fit is the client's to change (400, as SGLang's input length
    # check); generated tokens outgrowing the pool is the server's OOM (500).
    status = 500 if victim.output_ids else 400
    sched.finish_outside_step(victim, FinishReason(type="abort", message=message,
                                                   status_code=status))


__all__ = ["OOM_LAST_REQUEST_MESSAGE", "abort_unfittable", "retract_for_decode"]
