"""The scheduler's plug-in point (no torch): a *side* holds requests or pages beside the plain
prefill/decode loop -- PD prefill and PD decode (engine/sides/disagg_*.py, with decode retraction
and its KV backup inside the decode side) and speculative decoding (engine/sides/speculative.py)
and priority scheduling with its bounded queue (engine/sides/priority.py).

The scheduler calls every side at fixed points of a step, in the order the sides were
registered, and never asks which sides exist. A side is given the scheduler typed as
`SchedulerFacade` (engine/scheduler/facade.py) and touches nothing else of it
(tests/unit/test_side_facade.py checks the source).

Contract -- what a side may assume:
  - hooks run on the scheduler's thread, one at a time, between two runner calls;
  - a request it takes in `take` is its own until it hands it to the scheduler's queues
    (`waiting`, `running`) or ends it through `facade.finish`;
  - `on_finish` is called exactly once for every request the scheduler was given, whatever
    way it ends (stop, abort, out of memory, a failed transfer, a full queue, preemption, PD
    KV still in flight), because every ending goes through `Scheduler.finish`; its pages and
    row are freed by then, except pages a live PD transfer may still touch (the PD side
    frees those when the transfer ends). A request refused at arrival was never given:
    sides see it in `reject` instead.
What a side must guarantee:
  - every request it holds is reachable through `queued()` (and, if it holds pages,
    `kv_holders()`), so that aborts, dumps and the integrity check see it;
  - `has_work()` is true while it holds anything, `needs_poll()` while the runner must be
    called even with nothing to compute (ops to apply, transfers to poll);
  - `frees_memory_later()` is true while pages it holds will come back without a forward
    (the progress guarantee waits instead of aborting a request);
  - the ops it queues leave in `drain_ops()` (into the next SchedulerOutput's one op list),
    and it learns of their outcome only from the events of the RunnerOutput handed to
    `on_runner_output`;
  - `check()` raises AssertionError when its own bookkeeping is wrong.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # annotations only: the scheduler imports the sides, not the reverse
    from kvstrata.engine.request import Request
    from kvstrata.protocol import FinishReason, RunnerOutput


class SchedulerSide:
    """Every hook has a no-op default: a side overrides the points it cares about."""

    # Load-report keys (`load()`) that are running totals -> help: exported as Prometheus
    # counters kvstrata:<key> (engine/sides/registry.py side_counters(); metrics.py).
    counters: ClassVar[dict[str, str]] = {}

    # ---- arrival
    def validate(self, req: Request) -> str | None:
        """Why this request cannot be served here (a 400 message), or None."""
        return None

    def reject(self, req: Request) -> None:
        """`req` was refused before it was queued (already finished): undo what the peer
        waits for (e.g. abort its PD room at once)."""

    def prefetches_storage(self, req: Request) -> bool:
        """Whether `req`'s prompt pages are worth fetching from storage (HiCache L3) while it
        queues: False where this side brings its KV another way."""
        return True

    def take(self, req: Request) -> bool:
        """Arrival: True if the side keeps the request (in its own queue) instead of the
        scheduler's waiting queue."""
        return False

    # ---- a step
    def admission_order(self, waiting: list[Request]) -> list[Request] | None:
        """The waiting queue in the order prefill admits it, if this side decides it (the
        first side that answers wins); None leaves it to --schedule-policy."""
        return None

    def before_schedule(self) -> None:
        """Before the scheduler picks a batch: move own queues on (admission, resume)."""

    def make_room(self, req: Request, adder) -> bool:
        """The batch is full by request count (or out of rows) and `req` is next in line:
        True if the side made room for it (priority preemption through `facade.preempt`,
        adding what the victims held to `adder.rem_total`). `adder` is None when `req`
        already holds its KV (a decode server's transferred request: only a row is needed)."""
        return False

    def retract(self, req: Request) -> bool:
        """`req` was taken out of the running batch (priority preemption): True if the side
        keeps it its own way (a decode server backs its KV up: it cannot recompute the
        prompt); else the scheduler releases its KV and queues it for recompute."""
        return False

    def on_decode_oom(self) -> bool:
        """The decode batch cannot get its pages: True if the side freed memory its own way
        (the scheduler then does not recompute-retract)."""
        return False

    def begin_decode(self, batch: int) -> None:
        """A decode step of `batch` running requests is being scheduled (before `draft`)."""

    def draft(self, req: Request, limit: int, max_nodes: int | None = None) -> list[int]:
        """Draft tokens for `req`'s next decode step (a chain of at most `limit`; a
        TreeDraft at most `limit` deep and of at most `max_nodes` tokens), verified by the
        target in the same forward; [] = a plain decode step. The first side with a draft
        wins. The scheduler drops every draft of a step whose pages do not fit."""
        return []

    def on_verified(self, req: Request, drafted: int, produced: int) -> None:
        """A verify pass of `drafted` drafts gave `produced` tokens (accepted drafts + 1),
        before any stop condition cut them."""

    def on_token(self, req: Request, token: int, logprob, top_logprobs,
                 result: RunnerOutput) -> bool:
        """A sampled token for `req` (of the step's `result`, which may carry per-request
        side data: the PD seed, a draft's state): True if the side consumed it (the scheduler
        then does not append it or check stop conditions)."""
        return False

    def after_chunk(self, req: Request) -> None:
        """A chunk of `req`'s prompt was computed (it stays the chunked request)."""

    def on_runner_output(self, result: RunnerOutput) -> list[Request]:
        """The runner's events of this step; returns the requests that produced output."""
        return []

    def drain_ops(self) -> list:
        """The ops this side queued (protocol Op types), in order, for the next step."""
        return []

    # ---- endings
    def abort(self, rid: str, reason: FinishReason) -> Request | None:
        """A client abort of a request the side holds; None if it holds no such request."""
        return None

    def on_finish(self, req: Request) -> None:
        """`req` ended (called once, for every request, after its KV was released)."""

    # ---- state
    def has_work(self) -> bool:
        return False

    def needs_poll(self) -> bool:
        return False

    def frees_memory_later(self) -> bool:
        return False

    def queued(self) -> list[Request]:
        """Every request the side holds."""
        return []

    def kv_holders(self) -> list[Request]:
        """Requests outside the scheduler's live set that hold pages."""
        return []

    def load(self) -> dict:
        """Counters and queue lengths for /get_load, /metrics and /server_info."""
        return {}

    def dump_lines(self, brief) -> list[str]:
        """State dump lines (stall and watchdog logs); `brief(req)` formats one request."""
        return []

    def check(self) -> None:
        """Raise AssertionError if the side's bookkeeping is inconsistent."""


__all__ = ["SchedulerSide"]
