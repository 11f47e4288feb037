"""What the prefill and the decode side of PD disaggregation share (no torch).

One side per server (engine/sides/base.py; `sides.pd_side(scheduler)`, None when --disaggregation-mode
is null) owns the PD
queues, the metadata slots and the room table, and talks to the runner's transfer layer only
through `PDOp`s (queued here, shipped in the next SchedulerOutput) and `PDEvent`s (state
changes, read in Scheduler.update). protocol/disagg.py has the states and the op order.

A room is tracked from `*_create` until `release`. A request that ends while its transfer is
still live (client abort, error) is answered at once but its room is *draining*: the `abort`
op goes out and, if a transfer may still read or write its pages (prefill inflight, decode
transfer), the pages stay held until the room reports a terminal state (FAILED, or SUCCESS
if it raced); only then are they freed and `release` sent. So no page is reused while a
transfer can touch it, and no room is forgotten before the runner reported its end. (One
exception, harmless: a prefill request aborted mid-prefill frees the pages of chunks it
already streamed at once; a transfer reading them afterwards only fills pages of a decode
request that fails too, and those the decode side holds until its room ends.)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstrata.cache.state_pd import kv_pages_cross, state_pages
from kvstrata.cache.swa_pd import tail_start_page
from kvstrata.config.kv_plan import EAGLE_HIDDEN, page_bytes
from kvstrata.engine.request import Request
from kvstrata.engine.sides.base import SchedulerSide
from kvstrata.protocol import FinishReason, of_type
from kvstrata.protocol.disagg import KVPoll, PDEvent, PDOp

if TYPE_CHECKING:  # annotations only: no import circle
    from kvstrata.engine.scheduler.facade import SchedulerFacade

logger = logging.getLogger(__name__)

TERMINAL = (KVPoll.FAILED, KVPoll.SUCCESS)
BOOTSTRAP_REQUIRED = ("--disaggregation-mode {mode} requires bootstrap_host, bootstrap_port "
                      "and bootstrap_room on every request (the router adds them).")


@dataclass(eq=False)
class Room:
    req: Request
    state: int = KVPoll.BOOTSTRAPPING  # last state the runner reported
    slot: int = -1  # metadata slot, -1 = none
    draining: bool = False  # the request ended; waiting for the transfer's terminal state
    holds_kv: bool = False  # draining with pages a transfer may still touch
    sent_pages: int = 0  # prefill: pages already handed to `send`


def transferred_page_bytes(cfg) -> int:
    """Bytes one page moves: the target's KV, plus an EAGLE-family chain draft's KV (a second
    page buffer, runner/spec/handoff.py; trees keep theirs: scratch pages)."""
    plan = cfg.plan
    draft = [c for c in plan.draft_components if c.name != EAGLE_HIDDEN]
    if cfg.speculative_algorithm in ("EAGLE", "EAGLE3") and (cfg.speculative_eagle_topk or 1) == 1:
        return plan.bytes_per_page + page_bytes(draft, plan.page_size)
    return plan.bytes_per_page


class DisaggSide(SchedulerSide):
    """Base of PrefillDisagg / DecodeDisagg. Subclasses define `queues()` (name -> list, the
    requests waiting on PD), `kv_queues()` (those holding pages), `take`, `before_schedule`,
    `_on_success` and `_remove`."""

    mode = ""
    # Release of a draining request's pages: insert computed pages into the tree (prefill:
    # valid KV worth caching) or not (decode: received KV is never shared).
    insert_on_release = True

    def __init__(self, sched: SchedulerFacade, num_slots: int):
        self.sched = sched
        self.kv = sched.kv
        self.page_size = sched.page_size
        self.rooms: dict[int, Room] = {}
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots))
        self.ops: list[PDOp] = []
        self.num_transfer_failures = 0
        # KV bytes that crossed, a running total: pages the decode wrote into its reserved
        # pages (the prefill counts what the decode confirmed), as each room ends
        self.kv_bytes_moved = 0
        self.page_bytes_moved = transferred_page_bytes(sched.config)
        plan = sched.config.plan
        # hybrid SWA memory: an SWA page (the window layers' K/V) is smaller than a full one
        self.swa_page_bytes = page_bytes(plan.swa_components, plan.page_size) \
            if plan.has_swa_pool else 0
        # recurrent state: the request's final state slot crosses on the last chunk
        # (cache/state_pd.py); without K/V (Mamba2) it is all that crosses
        self.state_slot_bytes = plan.state_bytes_per_slot if plan.has_state_pool else 0
        self.kv_pages_cross = kv_pages_cross(plan)

    # ------------------------------------------------------------------ small helpers
    def queues(self) -> dict[str, list[Request]]:
        raise NotImplementedError

    def kv_queues(self) -> list[list[Request]]:
        raise NotImplementedError

    def validate(self, req: Request) -> str | None:
        if req.bootstrap is None:
            return BOOTSTRAP_REQUIRED.format(mode=self.mode)
        if req.bootstrap.room in self.rooms:
            return f"bootstrap_room {req.bootstrap.room} is already in use on this server."
        return None

    def emit(self, kind: str, room: int, **fields) -> None:
        self.ops.append(PDOp(room=room, kind=kind, **fields))

    def drain_ops(self) -> list:
        ops, self.ops = self.ops, []
        return ops

    def _create(self, req: Request, kind: str) -> None:
        b = req.bootstrap
        self.rooms[b.room] = Room(req)
        self.emit(kind, b.room, bootstrap_host=b.host, bootstrap_port=b.port)

    def _take_slot(self, room: Room) -> bool:
        if not self.free_slots:
            return False
        room.slot = self.free_slots.pop(0)
        return True

    def _room(self, req: Request) -> Room:
        return self.rooms[req.bootstrap.room]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def moved_bytes(self, pages: int, swa_pages: int, state_pages: int = 0) -> int:
        """Bytes of `pages` pages of a room that crossed, `swa_pages` of them the SWA pool's
        (hybrid SWA memory: smaller pages) and `state_pages` state slots (the transfer layer
        counts them, PDEvent)."""
        kv = pages - swa_pages - state_pages
        swa = self.swa_page_bytes or self.page_bytes_moved  # (page-only fakes: no SWA bytes)
        return (kv * self.page_bytes_moved + swa_pages * swa
                + state_pages * self.state_slot_bytes)

    def room_pages(self, prompt_len: int) -> int:
        """Pages a prompt's room moves (both sides count them alike): its full pages (none
        without K/V), the SWA pages of its last window, its final state slot."""
        full = self.pages_for(prompt_len) if self.kv_pages_cross else 0
        return full + self.swa_tail_pages(prompt_len) + state_pages(self.kv.plan)

    def swa_tail_pages(self, prompt_len: int) -> int:
        """SWA pages a prompt's transfer moves after its full pages (the last window,
        cache/swa_pd.py); 0 without an SWA pool. Both sides count them the same."""
        if self.kv.swa is None:
            return 0
        return self.pages_for(prompt_len) - min(
            tail_start_page(prompt_len, self.kv.swa.window, self.page_size),
            self.pages_for(prompt_len))

    # ------------------------------------------------------------------ scheduler hooks
    def has_work(self) -> bool:
        return bool(self.rooms or self.ops or any(self.queues().values()))

    def needs_poll(self) -> bool:
        """With no forward this step: still send an (empty) SchedulerOutput, so the runner
        applies the ops and polls the live transfers."""
        return bool(self.ops or self.rooms)

    def frees_memory_later(self) -> bool:
        """Pages are held by transfers that will end on their own (the progress guarantee
        must wait for them instead of declaring a stall)."""
        return any(self.kv_queues()) or any(r.holds_kv for r in self.rooms.values())

    def queued(self) -> list[Request]:
        return [r for q in self.queues().values() for r in q]

    def kv_holders(self) -> list[Request]:
        """Requests outside the scheduler's live set that hold pages (for the invariants)."""
        held = [r for q in self.kv_queues() for r in q]
        return held + [r.req for r in self.rooms.values() if r.holds_kv]

    def abort(self, rid: str, reason: FinishReason) -> Request | None:
        """Client abort of a request in a PD queue; None when it is in none of them."""
        for queue in self.queues().values():
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    if any(queue is q for q in self.kv_queues()) and self._room_live(req):
                        return self._end_holding_kv(req, reason)
                    return self.sched.finish(req, reason)
        return None

    def reject(self, req: Request) -> None:
        """A request refused before it joined a queue (a 400, `req` already finished): still
        open its room and abort it at once, so that the peer server fails its half now
        instead of after the bootstrap timeout (300 s by default). A missing or duplicate
        room is not ours to abort."""
        if req.bootstrap is None or req.bootstrap.room in self.rooms:
            return
        self._create(req, "sender_create" if self.mode == "prefill" else "receiver_create")
        self.rooms[req.bootstrap.room].draining = True
        self.emit("abort", req.bootstrap.room)

    def on_finish(self, req: Request) -> None:
        """Called by Scheduler.finish for every request that ends, whatever the path."""
        room = self.rooms.get(req.bootstrap.room) if req.bootstrap is not None else None
        if room is None or room.req is not req or room.draining:
            return
        if room.state in TERMINAL:
            self._forget(room)
        else:
            self.emit("abort", req.bootstrap.room)
            room.draining = True

    def on_runner_output(self, result) -> list[Request]:
        """Apply the runner's PD state changes; returns the requests that produced output."""
        touched: list[Request] = []
        for ev in of_type(result.events, PDEvent):
            room = self.rooms.get(ev.room)
            if room is None:
                logger.debug("PD event for unknown room %s ignored: %s", ev.room, ev)
                continue
            room.state = ev.state
            if ev.state in TERMINAL:  # what crossed, failed and aborted rooms included
                self.kv_bytes_moved += self.moved_bytes(ev.pages, ev.swa_pages,
                                                        ev.state_pages)
            if room.draining:
                if ev.state in TERMINAL:
                    self._end_drain(room)
                continue
            if ev.state == KVPoll.FAILED:
                self.num_transfer_failures += 1
                touched.append(self._fail(room, f"KV transfer failed (bootstrap room "
                                                f"{ev.room}): {ev.error or 'unknown error'}"))
            elif ev.state == KVPoll.SUCCESS:
                touched.append(self._on_success(room, ev))
        return [r for r in touched if r is not None]

    # ------------------------------------------------------------------ endings
    def _room_live(self, req: Request) -> bool:
        room = self.rooms.get(req.bootstrap.room)
        return room is not None and room.state not in TERMINAL

    def _end_holding_kv(self, req: Request, reason: FinishReason) -> Request:
        """End a request whose pages a live transfer may still touch: answer now, keep the
        pages until the room reports its end (`_end_drain` frees them). It still ends
        through the scheduler's one path, so every side's on_finish runs (this side's sees
        the room draining already and sends nothing more)."""
        room = self._room(req)
        room.draining = room.holds_kv = True
        self.emit("abort", req.bootstrap.room)
        return self.sched.finish(req, reason, release_kv=False)

    def _end_drain(self, room: Room) -> None:
        if room.holds_kv:
            self.kv.release(room.req, insert=self.insert_on_release)
            room.holds_kv = False
        self._forget(room)

    def _forget(self, room: Room) -> None:
        number = room.req.bootstrap.room
        # A send not shipped yet for a room that already ended would name freed pages.
        self.ops = [op for op in self.ops if not (op.room == number and op.kind == "send")]
        self.emit("release", number)
        if room.slot >= 0:
            self.free_slots.append(room.slot)
            room.slot = -1
        del self.rooms[number]

    def _fail(self, room: Room, message: str, status: int = 500) -> Request:
        """The transfer ended badly (its state is terminal): abort the request (500) and
        free what it holds now; Scheduler.finish -> on_finish sends `release`."""
        req = room.req
        logger.warning("PD request %s aborted: %s", req.rid, message)
        reason = FinishReason(type="abort", message=message, status_code=status)
        if not self._remove(req):
            return self.sched.abort(req.rid, reason)  # in the scheduler's own queues
        if not self.insert_on_release:
            self.kv.release(req, insert=False)
        return self.sched.finish(req, reason)

    def _remove(self, req: Request) -> bool:
        for queue in self.queues().values():
            if req in queue:
                queue.remove(req)
                return True
        return False

    def _on_success(self, room: Room, ev: PDEvent) -> Request | None:
        raise NotImplementedError

    # ------------------------------------------------------------------ introspection
    def load(self) -> dict:
        moved = ("disagg_kv_bytes_sent_total" if self.mode == "prefill"
                 else "disagg_kv_bytes_received_total")
        return {**{f"num_{self.mode}_{name}": len(q) for name, q in self.queues().items()},
                moved: self.kv_bytes_moved}

    def dump_lines(self, brief) -> list[str]:
        lines = [f"pd {self.mode}: " + ", ".join(f"{n} {len(q)}" for n, q in self.queues().items())
                 + f"; rooms {len(self.rooms)} (draining "
                 f"{sum(r.draining for r in self.rooms.values())}); metadata slots free "
                 f"{len(self.free_slots)}/{self.num_slots}; ops pending {len(self.ops)}"]
        for name, queue in self.queues().items():
            lines += [f"{name}: " + brief(r) + f" room_state={self._state_name(r)}"
                      for r in queue[:16]]
        return lines

    def _state_name(self, req: Request) -> str:
        room = self.rooms.get(req.bootstrap.room)
        return KVPoll(room.state).name if room is not None else "released"

    def check(self) -> None:
        queued = [r for q in self.queues().values() for r in q]
        assert len({id(r) for r in queued}) == len(queued), "a request is in two PD queues"
        holding = {id(r) for q in self.kv_queues() for r in q}
        for req in queued:
            assert not req.row, f"{req.rid}: a PD-queued request holds a row"
            if id(req) not in holding:
                assert not req.pages and req.last_node is None, f"{req.rid} holds KV"
        used = [r.slot for r in self.rooms.values() if r.slot >= 0]
        assert len(used) + len(self.free_slots) == self.num_slots, "metadata slot leak"
        assert len(set(used + self.free_slots)) == self.num_slots, "a metadata slot twice"
        for number, room in self.rooms.items():
            assert room.req.bootstrap.room == number, "room table out of order"
            if room.draining:
                assert room.req.is_finished, f"{room.req.rid}: draining but not finished"
            if not room.holds_kv and room.draining:
                assert not room.req.pages, f"{room.req.rid}: draining with untracked pages"
