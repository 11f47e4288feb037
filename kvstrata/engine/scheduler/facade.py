"""What a side may use of the scheduler (no torch): the one typed interface between the
scheduler core and its plug-in sides (engine/sides/base.py). `Scheduler` implements it; a
side is given the scheduler typed as this Protocol and touches nothing else of it
(tests/unit/test_side_facade.py walks the sides' source and fails otherwise).

Reads: the config, the KV manager, the page size, and the core's queues as read-only
sequences (a side never mutates them: it hands requests over with `enqueue` /
`start_running`, takes them back with `stop_running`, ends them with `finish`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # annotations only
    from kvstrata.cache.kv_manager import KVManager
    from kvstrata.engine.request import Request
    from kvstrata.engine.scheduler.config import SchedulerConfig
    from kvstrata.protocol import FinishReason


@runtime_checkable
class SchedulerFacade(Protocol):
    config: SchedulerConfig
    kv: KVManager
    page_size: int

    # ---- the core's queues, read only
    @property
    def waiting(self) -> Sequence[Request]: ...

    @property
    def running(self) -> Sequence[Request]: ...

    @property
    def chunked_req(self) -> Request | None: ...

    # ---- handing requests over and back
    def enqueue(self, req: Request) -> None:
        """To the waiting queue (prefill, with prefix matching)."""

    def start_running(self, req: Request) -> bool:
        """A request whose KV is complete joins the decode batch if a row is free."""

    def stop_running(self, req: Request) -> None:
        """Out of the decode batch; its pages stay with it."""

    def preempt(self, victim: Request) -> None:
        """Out of the batch for a better request: a side's way (retract hook), else
        recompute."""

    def retract_one(self, victim: Request) -> None:
        """Release a request's pages and row, and reset it to be computed again."""

    def make_room(self, req: Request, adder=None) -> bool:
        """Ask the sides to make room for `req` in a full batch."""

    # ---- endings: the one end path (Scheduler.finish)
    def finish(self, req: Request, reason: FinishReason, *, release_kv: bool = True) -> Request:
        """End `req` (already out of every queue): KV, row, runner, every side's on_finish."""

    def finish_outside_step(self, req: Request, reason: FinishReason) -> None:
        """finish() for a request that produced no token this step (reported all the same)."""

    def drop_waiting(self, req: Request, reason: FinishReason) -> None:
        """End a request of the waiting queue (evicted from a full queue)."""

    def abort(self, rid: str, reason: FinishReason) -> Request | None:
        """End a request wherever it is; None when none has this id."""

    # ---- bookkeeping a side shares with the core
    def forget_in_runner(self, req: Request) -> None:
        """The runner drops the request's state at the next step."""

    def free_row(self, req: Request) -> None:
        """Give the request's req_to_token row back."""

    def count_retractions(self, retracted: int, remaining: list[Request]) -> None:
        """Count retractions and let the new-token ratio react to them."""

    def decode_pages_needed(self, reqs: list[Request], drafts: dict | None = None) -> int:
        """Pages the next decode step of `reqs` needs."""

    def reserved_tokens(self, req: Request) -> int:
        """Tokens prefill admission keeps free for `req`'s remaining output."""

    def check_stop(self, req: Request) -> FinishReason | None:
        """Whether `req` is finished after its last token (stop tokens, strings, length)."""


__all__ = ["SchedulerFacade"]
