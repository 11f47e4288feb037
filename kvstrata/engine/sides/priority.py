"""Priority scheduling and the bounded waiting queue (no torch), SGLang's semantics.

A request's priority is an int (the `priority` field of /generate and the OpenAI routes).
  - Default: `--default-priority-value` when the request gives none (the engine applies it
    on arrival); with priority scheduling on and still none, the least preferred value
    (`sys.maxsize` when low values go first, else `-sys.maxsize - 1`). Priority scheduling
    off: a request that gives one is refused (503) under `--abort-on-priority-when-disabled`,
    else the value is ignored.
  - Order: the waiting queue (and the PD bootstrap / prealloc queues) sorts by
    `(priority * sign, arrival)`, sign +1 when low values go first
    (`--schedule-low-priority-values-first`), else -1; with `--schedule-policy lof` the
    longest max_new_tokens comes second. fcfs and lof are the only policies that combine with
    priority scheduling (config/arg_checks.py refuses the others).
  - Preemption (on unless `--disable-priority-preemption`): when the prefill round is full by
    request count (never when it only ran out of tokens), the next waiting request may take
    the place of running requests: candidates least preferred first (newest first among
    equals), taken while `(new - running) * -sign > --priority-scheduling-preemption-threshold`,
    each subtracting what it holds (its tokens + its decode reserve) from the tokens still
    needed (`uncached input + min(max_new_tokens, 4096) - remaining budget`), until enough is
    freed; nothing qualifies, or not enough: nobody is preempted. Victims are retracted (their
    committed tokens are kept and recomputed, as after a decode retraction) and wait again.
    A PD decode server preempts when a transferred request (its KV already in place) finds
    the batch full: one victim, backed up like a decode retraction (its prompt cannot be
    recomputed there) and restored later.
  - `--max-queued-requests` (co-located servers, as SGLang): a full waiting queue refuses the
    newcomer (503 "The request queue is full."), or with priority scheduling evicts its least
    preferred request (newest on a tie) when the newcomer is strictly better.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from kvstrata.engine.scheduler.new_token_ratio import CLIP_MAX_NEW_TOKENS_ESTIMATION
from kvstrata.engine.sides.base import SchedulerSide
from kvstrata.protocol import FinishReason

if TYPE_CHECKING:  # annotations only: no import circle
    from kvstrata.engine.scheduler.facade import SchedulerFacade

if TYPE_CHECKING:  # annotations only
    from kvstrata.engine.request import Request

PRIORITY_DISABLED_MESSAGE = ("Using priority is disabled for this server. Please send a new "
                             "request without a priority.")
QUEUE_FULL_MESSAGE = "The request queue is full."
EVICTED_MESSAGE = "The request is aborted by a higher priority request."


def resolve_priority(config, priority: int | None) -> tuple[int | None, str | None]:
    """A newcomer's priority, or the 503 message that refuses it (see the module doc)."""
    if priority is None:
        priority = config.default_priority_value
    if config.enable_priority_scheduling:
        if priority is None:
            priority = sys.maxsize if config.priority_sign > 0 else -sys.maxsize - 1
        return priority, None
    if priority is not None and config.abort_on_priority_when_disabled:
        return priority, PRIORITY_DISABLED_MESSAGE
    return priority, None


def queue_key(config):
    """Sort key of a queue under priority scheduling: most preferred first."""
    sign = config.priority_sign
    if config.schedule_policy == "lof":
        return lambda r: (r.priority * sign, -r.params.max_new_tokens, r.arrival_index)
    return lambda r: (r.priority * sign, r.arrival_index)


def priority_order(config, reqs: list[Request]) -> list[Request]:
    """`reqs` in service order: by priority when priority scheduling is on, else as given."""
    if not config.enable_priority_scheduling:
        return list(reqs)
    return sorted(reqs, key=queue_key(config))


def _least_preferred_first(config):
    """Sort key: the least preferred request first, the newest first among equals."""
    sign = config.priority_sign
    return lambda r: (-(r.priority * sign), -r.arrival_index)


class PrioritySide(SchedulerSide):
    counters = {
        "num_preempted_reqs": "Running requests preempted for a higher-priority one",
        "num_queue_full_refused_reqs": "Requests refused because the waiting queue was full",
        "num_queue_full_evicted_reqs": "Waiting requests evicted from a full queue by a "
                                       "higher-priority one",
    }

    """The bounded queue at arrival and preemption when the batch is full (module doc)."""

    def __init__(self, sched: SchedulerFacade):
        self.sched = sched
        cfg = sched.config
        self.config = cfg
        self.preemption = cfg.priority_preemption
        self.threshold = cfg.priority_scheduling_preemption_threshold
        # SGLang bounds the queue of co-located servers only (a PD server's queues wait on
        # the peer, not on this server's compute).
        self.limit = cfg.max_queued_requests if cfg.disaggregation_mode == "null" else None
        self.num_preempted = 0
        self.num_queue_full_refused = 0
        self.num_queue_full_evicted = 0

    # ---- arrival: the bounded queue
    def take(self, req: Request) -> bool:
        sched = self.sched
        if self.limit is None or len(sched.waiting) + 1 <= self.limit:
            return False
        if self.config.enable_priority_scheduling:
            victim = min(sched.waiting, key=_least_preferred_first(self.config))
            sign = self.config.priority_sign
            if req.priority * sign < victim.priority * sign:
                self.num_queue_full_evicted += 1
                sched.drop_waiting(victim, FinishReason(
                    type="abort", message=EVICTED_MESSAGE, status_code=503))
                return False
        self.num_queue_full_refused += 1
        sched.finish_outside_step(req, FinishReason(type="abort", message=QUEUE_FULL_MESSAGE,
                                                    status_code=503))
        return True

    # ---- a full batch: preemption
    def admission_order(self, waiting: list[Request]) -> list[Request] | None:
        """Priority scheduling admits by priority (then arrival); a bounded queue alone leaves
        the order to --schedule-policy."""
        return priority_order(self.config, waiting) if self.config.enable_priority_scheduling \
            else None

    def make_room(self, req: Request, adder) -> bool:
        if not self.preemption:
            return False
        sched, kv, sign = self.sched, self.sched.kv, self.config.priority_sign
        # A request that holds its KV (adder None: PD decode) only needs a running slot.
        need = 0 if adder is None else (
            req.seq_len - kv.peek_prefix_len(req.all_ids, salt=req.cache_salt)
            + min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS_ESTIMATION)
            - adder.rem_total)
        victims: list[Request] = []
        for running in sorted((r for r in sched.running if not r.is_finished),
                              key=_least_preferred_first(self.config)):
            if (req.priority - running.priority) * -sign <= self.threshold:
                break  # least preferred first: no later candidate qualifies either
            victims.append(running)
            need -= running.seq_len + sched.reserved_tokens(running)
            if need <= 0:
                break
        if not victims or need > 0:
            return False
        reserved = sum(sched.reserved_tokens(v) for v in victims)
        empty_after = (adder is not None and len(victims) == len(sched.running)
                       and sched.chunked_req is None and not adder.items)
        if adder is not None:
            # SGLang's arithmetic above may promise more than admission will grant (our
            # budget counts whole pages and a full decode reserve): preempt only if the
            # newcomer is then admitted, counting only the victims' own pages (tree pages
            # may stay pinned) -- a preemption that admits nobody would stall the round.
            prefix = kv.peek_prefix_len(req.all_ids, salt=req.cache_salt)
            own = sum(len(v.pages) - v.num_tree_pages for v in victims) * kv.page_size
            if not adder.fits(req, req.seq_len - prefix, prefix, own + reserved, empty_after):
                return False
        before, swa_before = kv.full_allocatable_tokens(), kv.swa_allocatable_tokens()
        for victim in victims:
            sched.preempt(victim)  # retracted (decode server: backed up) and queued again
        if adder is not None:
            adder.rem_total += kv.full_allocatable_tokens() - before + reserved
            if swa_before is not None:  # hybrid SWA: what the victims' SWA pages give back
                adder.rem_swa += kv.swa_allocatable_tokens() - swa_before
            adder.running_empty = adder.running_empty or empty_after
        self.num_preempted += len(victims)
        return True

    # ---- state
    def load(self) -> dict:
        out = {"num_preempted_reqs": self.num_preempted,
               "num_queue_full_refused_reqs": self.num_queue_full_refused,
               "num_queue_full_evicted_reqs": self.num_queue_full_evicted}
        if self.config.enable_priority_scheduling:
            counts: dict[str, int] = {}
            for r in self.sched.waiting:
                counts[str(r.priority)] = counts.get(str(r.priority), 0) + 1
            out["num_waiting_reqs_by_priority"] = counts
        return out


__all__ = ["EVICTED_MESSAGE", "PRIORITY_DISABLED_MESSAGE", "PrioritySide", "QUEUE_FULL_MESSAGE",
           "priority_order", "queue_key", "resolve_priority"]
