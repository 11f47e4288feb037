"""The prefill server of PD disaggregation (SGLang's disaggregation/prefill.py; no torch).

A request's path (docs/architecture.md, "PD disaggregation"):
  bootstrap  `sender_create`; max_new_tokens forced to 1 (the admission budget reserves one
             output token; the prefill server never decodes). When the sender reports
             WAITING_FOR_INPUT (the decode server sent its destination pages) and a metadata
             slot is free: `sender_init(num_pages, metadata_index)`, then the normal waiting
             queue (FIFO over ready requests; no free slot -> stop).
  prefill    the scheduler's own path: chunked prefill, prefix cache, admission budget.
             After each non-last chunk, the full pages computed so far and not yet sent go
             out (`send(page_ids, last=False)`, after_chunk): the transfer overlaps the prefill.
  inflight   after the last chunk's forward (Scheduler.update -> on_token): the sampled first
             token and its logprob(s) are recorded, the prompt's full pages go to the radix
             tree (locked, so a request sharing the prefix can hit them already), the row is
             freed and the runner forgets the request; `send(page_ids = the prompt pages not
             sent yet, in order, last=True, metadata)`. The pages stay locked / owned until the room ends:
             SUCCESS -> finished (length), KV released into the tree, slot freed, `release`;
             FAILED -> abort 500 with the transfer's error, same release.
Metadata slots: 2 x max_running_requests (a slot is held from sender_init to the room's end).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvstrata.cache.state_pd import state_wire_ids
from kvstrata.cache.swa_pd import prefill_tail_wire_ids
from kvstrata.engine.request import Request
from kvstrata.engine.sides.disagg_common import DisaggSide, Room
from kvstrata.engine.sides.priority import priority_order
from kvstrata.protocol import FinishReason
from kvstrata.protocol.disagg import DSA_SEED_KEY, KVPoll, PDEvent, PDMetadata
from kvstrata.protocol.scheduler_output import RunnerOutput

if TYPE_CHECKING:  # annotations only: no import circle
    from kvstrata.engine.scheduler.facade import SchedulerFacade

PREFILL_SLOTS_PER_ROW = 2


class PrefillDisagg(DisaggSide):
    counters = {
        "disagg_kv_bytes_sent_total": "KV bytes this prefill server shipped that decode "
                                      "servers confirmed they wrote into a room's pages "
                                      "(equals their disagg_kv_bytes_received_total, "
                                      "aborted requests included)",
    }
    mode = "prefill"
    insert_on_release = True

    def __init__(self, sched: SchedulerFacade):
        super().__init__(sched, PREFILL_SLOTS_PER_ROW * sched.config.max_running_requests)
        self.bootstrap: list[Request] = []
        self.inflight: list[Request] = []

    def queues(self) -> dict[str, list[Request]]:
        return {"bootstrap": self.bootstrap, "inflight": self.inflight}

    def kv_queues(self) -> list[list[Request]]:
        return [self.inflight]

    def take(self, req: Request) -> bool:
        req.params = dataclasses.replace(req.params, max_new_tokens=1, min_new_tokens=0)
        self._create(req, "sender_create")
        self.bootstrap.append(req)
        return True

    def before_schedule(self) -> None:
        """Bootstrapped requests (decode has sent its pages) join the waiting queue, in
        priority order under priority scheduling."""
        for req in priority_order(self.sched.config, self.bootstrap):
            room = self._room(req)
            if room.state != KVPoll.WAITING_FOR_INPUT:
                continue
            if not self._take_slot(room):
                break
            self.emit("sender_init", req.bootstrap.room,
                      num_pages=self.room_pages(len(req.prompt_ids)), metadata_index=room.slot)
            self.bootstrap.remove(req)
            self.sched.enqueue(req)

    def after_chunk(self, req: Request) -> None:
        """A non-last chunk was computed (and its full pages cached): send the full pages not
        sent yet (last=False), so the transfer overlaps the rest of the prefill. Chunks end
        on page boundaries; the pages sent stay tree-locked, so their ids never change."""
        room = self._room(req)
        full = req.num_computed_tokens // self.page_size
        if full > room.sent_pages and self.kv_pages_cross:
            self.emit("send", req.bootstrap.room, page_ids=req.pages[room.sent_pages:full])
            room.sent_pages = full

    def on_token(self, req: Request, token: int, logprob: float | None, top,
                 result: RunnerOutput) -> bool:
        """The last prefill chunk sampled the first output token: send the KV (and, for a
        DSA model, the runner's top-k seed in the metadata's extras; for an EAGLE-family
        draft, its state after the draft-extend)."""
        dsa_seed = result.dsa_seeds.get(req.rid)
        sched = self.sched
        req.output_ids.append(token)
        if logprob is not None:
            req.pending_logprobs.append(logprob)
            req.pending_top_logprobs.append(top or [])
        self.kv.cache_unfinished(req)  # full prompt pages -> tree, locked (no-op without it)
        sched.free_row(req)
        sched.forget_in_runner(req)
        room = req.bootstrap.room
        sent = self.rooms[room].sent_pages
        # hybrid SWA memory: the window layers' pages of the prompt's last window go last
        tail = prefill_tail_wire_ids(self.kv, req, len(req.prompt_ids)) \
            if self.kv.swa is not None else []
        # recurrent state: the working slot, holding the state after the whole prompt (the
        # request keeps it, unwritten, until the room ends), crosses last
        full = req.pages[sent:] if self.kv_pages_cross else []
        pages = full + tail + state_wire_ids(self.kv.plan, req)
        self.emit("send", room, page_ids=pages, last=True, metadata=PDMetadata(
            room=room, first_token_id=token, first_logprob=logprob,
            first_top_logprobs=list(top) if top else None, cached_tokens=req.cached_tokens,
            extras={DSA_SEED_KEY: dsa_seed} if dsa_seed is not None else {},
            spec=result.spec_handoffs.get(req.rid)))
        self.inflight.append(req)
        return True

    def _on_success(self, room: Room, ev: PDEvent) -> Request | None:
        req = room.req
        if req not in self.inflight:
            return self._fail(room, f"KV transfer of bootstrap room {ev.room} reported "
                                    f"success before its pages were sent.")
        self.inflight.remove(req)
        return self.sched.finish(req, FinishReason(type="length"))
