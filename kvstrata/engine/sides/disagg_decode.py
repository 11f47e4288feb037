"""The decode server of PD disaggregation (SGLang's disaggregation/decode.py; no torch).

The KV manager runs without prefix matching here (chunk-cache semantics: received KV is
never shared, and a finished request's pages are simply freed) unless
--disaggregation-decode-enable-radix-cache: then a finished request's KV goes to the radix
tree, and at admission the prompt's cached whole pages are matched (the last token too: the
first output token comes from the prefill) and locked for the request's lifetime; only the
pages after them are reserved and transferred (`receiver_init(prefix_pages=...)`: the
prefill sends every page as usual, its transfer backend skips the held ones). Cached pages
are evicted under memory pressure as on a co-located server. With hybrid SWA memory the tree is
the SWA radix cache: a hit needs a live window before its end, the request keeps the tree's SWA
pages there and takes new ones for the rest of its last window (cache/swa_pd.py). A request's path:
  prealloc   `receiver_create`. Once its receiver reports WAITING_FOR_INPUT it is admitted,
             FIFO, or by priority under priority scheduling (requests still bootstrapping are skipped; the first ready one that does not
             fit stops the pass), every `--disaggregation-decode-polling-interval` steps, when
             - fewer than max_running_requests + extra slots requests hold decode KV (running
               + in transfer + transferred; the extra slots are SGLang's
               --disaggregation-decode-extra-slots, default 2 x max_running_requests when
               that is <= 32, else 0),
             - a metadata slot is free (max_running_requests + extra slots of them),
             - SGLang's token budget allows, in whole pages (R = --num-reserved-decode-tokens):
                 allocatable = free (+ evictable) tokens - max(R x #holding, need_single)
                 need_single = max over running of min(max_new, 4096) + prompt - retractable
                 retractable = sum of running requests' lengths
               admit iff max(pages(prompt) + R, pages(prompt) + min(max_new, 4096) -
               retractable) <= allocatable; then allocatable -= pages(prompt) + R. When no
               request holds decode KV at all, the head is admitted whenever its pages are
               free (so a large R cannot stall an idle server).
             Its prompt's pages are allocated (after the cached prefix, if any):
             `receiver_init(page_ids, metadata_index, prefix_pages)`.
  transfer   SUCCESS: the metadata must name the request's room ("Context corruption
             detected" abort otherwise); the first token (+ logprobs) is appended and
             reported this step, cached_tokens copied, the prompt counts as computed (KV
             present: "prebuilt", no forward); slot freed, `release`. Stop conditions apply
             to the first token. FAILED: abort 500 with the error, pages freed.
  prebuilt   joins the running batch when a row is free (rows are taken only here: the
             runner's req_to_token has max_running_requests rows), then the normal decode
             loop (its first decode step writes the whole row).
Out of memory: a decode server never computed the prompt, so it cannot recompute-retract.
It retracts in SGLang's order but backs the victims' KV up first (engine/sides/disagg_retract.py);
retracted requests are resumed, restored into new pages, before any new admission.
"""
from __future__ import annotations

import msgspec
from typing import TYPE_CHECKING

from kvstrata.cache.state_pd import state_wire_ids
from kvstrata.cache.swa_pd import decode_tail_wire_ids, grow_swa_tail, held_tail_pages
from kvstrata.engine.request import Request
from kvstrata.engine.scheduler.new_token_ratio import CLIP_MAX_NEW_TOKENS_ESTIMATION
from kvstrata.engine.sides.disagg_common import DisaggSide, Room
from kvstrata.engine.sides.disagg_retract import DecodeRetraction
from kvstrata.engine.sides.priority import priority_order
from kvstrata.protocol.disagg import KVPoll, PDEvent, dsa_seed_from_extras

if TYPE_CHECKING:  # annotations only: no import circle
    from kvstrata.engine.scheduler.facade import SchedulerFacade


class DecodeDisagg(DisaggSide):
    counters = {
        "disagg_kv_bytes_received_total": "KV bytes this decode server wrote into its "
                                          "rooms' reserved pages while they were live "
                                          "(aborted requests included; what the prefill "
                                          "servers count as sent)",
        "disagg_decode_prefix_hit_tokens_total": "Prompt tokens a decode server's radix cache "
                                                 "already held (not transferred)",
        "disagg_metadata_bytes_received_total": "Transfer metadata bytes a decode server "
                                                "received (first token, logprobs, DSA seed, "
                                                "draft state)",
    }
    mode = "decode"
    insert_on_release = False

    def __init__(self, sched: SchedulerFacade):
        cfg = sched.config
        self.max_holding = cfg.max_running_requests + cfg.decode_extra_slots
        super().__init__(sched, self.max_holding)
        self.reserved = cfg.num_reserved_decode_tokens
        self.interval = max(cfg.disaggregation_decode_polling_interval, 1)
        self.prealloc: list[Request] = []
        self.transfer: list[Request] = []
        self.prebuilt: list[Request] = []
        self._polls = 0
        self.retraction = DecodeRetraction(self, cfg.retraction_backup)
        # --disaggregation-decode-enable-radix-cache: prompts' cached prefixes stay here.
        self.radix = cfg.radix_cache
        self.prefix_hit_tokens = 0
        self.metadata_bytes = 0  # encoded PDMetadata received (seed, draft state included)

    def queues(self) -> dict[str, list[Request]]:
        return {"prealloc": self.prealloc, "transfer": self.transfer, "prebuilt": self.prebuilt,
                "retracted": self.retraction.retracted}

    def kv_queues(self) -> list[list[Request]]:
        return [self.transfer, self.prebuilt]

    def prefetches_storage(self, req: Request) -> bool:
        return False  # its KV comes from the prefill server

    def take(self, req: Request) -> bool:
        # The prompt is never run here: its logprobs (echo) can only come from the prefill.
        req.return_prompt_logprobs = False
        self._create(req, "receiver_create")
        self.prealloc.append(req)
        return True

    def before_schedule(self) -> None:
        self._polls += 1
        # Retracted requests come back first; while any is left, nothing new is admitted.
        self.retraction.resume()
        if self._polls % self.interval == 0 and not self.retraction.retracted:
            self._admit()
        self._join_running()

    def drain_ops(self) -> list:
        # Backups first: the runner applies them before anything else in any case.
        return self.retraction.drain_ops() + super().drain_ops()

    def has_work(self) -> bool:
        return super().has_work() or bool(self.retraction.ops)

    def needs_poll(self) -> bool:
        return super().needs_poll() or bool(self.retraction.ops)

    # ------------------------------------------------------------------ admission
    def holding(self) -> int:
        return len(self.sched.running) + len(self.transfer) + len(self.prebuilt)

    def budget(self) -> tuple[int, int]:
        running = self.sched.running
        retractable = sum(r.seq_len for r in running)
        need_single = max((min(r.params.max_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATION)
                           + len(r.prompt_ids) - retractable for r in running), default=0)
        reserved = self.reserved * self.holding()
        return self.full_allocatable() - max(reserved, need_single), retractable

    def full_allocatable(self) -> int:
        """Tokens the prompts' full pages may take. With an SWA pool only the full pool: a
        received prompt takes SWA pages for its last window only (`_swa_fits` checks those),
        so the smaller SWA pool must not cap prompts far longer than the window."""
        kv = self.kv
        return kv.full_allocatable_tokens() if kv.swa is not None else kv.allocatable_tokens()

    def swa_fits(self, num_tokens: int, spent: int) -> bool:
        """The last-window SWA pages of `num_tokens` tokens (a prompt, a retracted request's
        backup), and room for its next decode tokens, fit the SWA pool after `spent` SWA
        tokens this pass already took. Its decode tokens take R (--num-reserved-decode-
        tokens, 512 by default) in the full pool but at most a window and two pages in the
        SWA pool (the out-of-window ones are freed as it goes): reserving R there would keep
        a small SWA pool from admitting anything."""
        swa = self.kv.swa
        if swa is None:
            return True
        tail = self.swa_tail_pages(num_tokens) * self.page_size
        reserve = min(self.reserved, swa.per_request_tokens)
        return tail + reserve <= self.kv.swa_allocatable_tokens() - spent

    def _admit(self) -> None:
        allocatable, retractable = self.budget()
        P = self.page_size
        swa_spent = 0
        for req in priority_order(self.sched.config, self.prealloc):
            room = self._room(req)
            if room.state != KVPoll.WAITING_FOR_INPUT:
                continue
            if self.holding() >= self.max_holding or not self.free_slots:
                break
            # Decode radix cache: the cached whole pages of the prompt are not transferred
            # again; only the rest is reserved (a dry run first: a head that does not fit
            # is retried every poll and must not touch the tree's stamps or statistics).
            held = self.kv.peek_prefix_len(req.prompt_ids, whole_prompt=True,
                                           salt=req.cache_salt) \
                if self.radix else 0
            need = self.pages_for(len(req.prompt_ids)) * P - held
            clip = min(req.params.max_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATION)
            fits = max(need + self.reserved, need + clip - retractable) <= allocatable
            idle = not self.holding() and not self.frees_memory_later()
            if not (fits or (idle and need <= self.full_allocatable())) or \
                    not self.swa_fits(len(req.prompt_ids), swa_spent):
                break
            if self.radix:  # lock the prefix for the request's lifetime (with a decode
                # HiCache, host-resident pages of it are loaded back first: not re-sent)
                held = self.kv.match_and_lock(req, whole_prompt=True)
            # hybrid SWA memory: SWA pages for the last window only (alloc_extend_swa_tail),
            # those of it past the cached prefix (the tree holds the rest live)
            grown = grow_swa_tail(self.kv, req, len(req.prompt_ids)) \
                if self.kv.swa is not None else self.kv.grow(req, len(req.prompt_ids))
            # recurrent state: a slot for the prompt's final state to land in (no reset at
            # its first decode step: the transfer fills it)
            if not grown or not self.kv.assign_state_slot(req):
                self.kv.release(req, insert=False)  # the match's lock, the pages grown
                break
            swa_spent += self.swa_tail_pages(len(req.prompt_ids)) * P
            self._take_slot(room)
            allocatable -= need + self.reserved
            self.prefix_hit_tokens += held
            self.prealloc.remove(req)
            self.transfer.append(req)
            tail, held_tail = [], 0
            if self.kv.swa is not None:
                tail = decode_tail_wire_ids(self.kv, req, len(req.prompt_ids))
                held_tail = held_tail_pages(self.kv, req, len(req.prompt_ids))
            full = list(req.pages[req.num_tree_pages:]) if self.kv_pages_cross else []
            self.emit("receiver_init", req.bootstrap.room,
                      page_ids=full + tail + state_wire_ids(self.kv.plan, req),
                      metadata_index=room.slot, prefix_pages=req.num_tree_pages,
                      prefix_swa_pages=held_tail)

    def _join_running(self) -> None:
        sched = self.sched
        for req in priority_order(sched.config, self.prebuilt):
            # A full batch: priority preemption may back a worse running request up.
            if not (sched.start_running(req) or (sched.make_room(req)
                                                 and sched.start_running(req))):
                break
            self.prebuilt.remove(req)

    def retract(self, req: Request) -> bool:
        """A running request preempted for a better one: backed up like a decode retraction
        (a decode server cannot recompute its prompt) and restored later."""
        self.retraction.preempt(req)
        return True

    # ------------------------------------------------------------------ transfer done
    def _on_success(self, room: Room, ev: PDEvent) -> Request | None:
        req, md = room.req, ev.metadata
        if req not in self.transfer:
            return self._fail(room, f"KV transfer of bootstrap room {ev.room} reported "
                                    f"success before its pages were reserved.")
        if md is None:
            return self._fail(room, f"KV transfer of bootstrap room {ev.room} finished "
                                    f"without its metadata.")
        if md.room != req.bootstrap.room:
            return self._fail(room, f"Context corruption detected: the KV metadata is for "
                                    f"bootstrap room {md.room}, the request has room "
                                    f"{req.bootstrap.room}.")
        self.transfer.remove(req)
        req.output_ids.append(md.first_token_id)
        if req.params.logprobs is not None and md.first_logprob is not None:
            req.pending_logprobs.append(md.first_logprob)
            req.pending_top_logprobs.append(list(md.first_top_logprobs or []))
        req.cached_tokens = md.cached_tokens
        req.dsa_seed_positions = dsa_seed_from_extras(md.extras)
        req.spec_handoff = md.spec
        self.metadata_bytes += len(msgspec.msgpack.encode(md))
        req.num_computed_tokens = len(req.prompt_ids)
        req.row_stale_from = 0
        self._forget(room)
        reason = self.sched.check_stop(req)
        if reason is not None:
            return self.sched.finish(req, reason)
        self.prebuilt.append(req)
        return req

    def on_finish(self, req: Request) -> None:
        self.retraction.discard(req)  # a retracted request that ends drops its backup
        super().on_finish(req)

    # ------------------------------------------------------------------ out of memory
    def on_decode_oom(self) -> bool:
        self.retraction.on_decode_oom()  # never recompute: back up, retract, resume later
        return True

    # ------------------------------------------------------------------ introspection
    def load(self) -> dict:
        out = {**super().load(), **self.retraction.load(),
               "disagg_decode_prefix_hit_tokens_total": self.prefix_hit_tokens,
               "disagg_metadata_bytes_received_total": self.metadata_bytes}
        if self.radix:
            out["decode_prefix_hit_tokens"] = self.prefix_hit_tokens
        return out

    def dump_lines(self, brief) -> list[str]:
        return super().dump_lines(brief) + [self.retraction.dump_line()]

    def check(self) -> None:
        super().check()
        self.retraction.check()
