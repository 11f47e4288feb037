"""Continuous-batching scheduler (no torch): decides, per step, what the runner computes.

One step is either a prefill batch (prefill goes first) or a decode step over every running
request. Long prompts are prefilled in chunks; between chunks their computed pages go to the
radix tree. When a decode step cannot get its pages, requests are retracted (the chunked one
first, then fewest generated tokens, ties: longest prompt) and later recomputed, usually from
prefix-cache hits. A step that would compute nothing while work waits aborts the request that
cannot fit alone (progress guarantee). docs/architecture.md: the request lifecycle. The
prefill step's admission is a mixin (prefill_step.py).
"""
from __future__ import annotations

from kvstrata.cache.kv_manager import KVManager
from kvstrata.engine.request import Request, RequestStatus
from kvstrata.engine.scheduler.config import SchedulerConfig
from kvstrata.engine.scheduler.new_token_ratio import NewTokenRatio
from kvstrata.engine.scheduler.out_of_memory import (OOM_LAST_REQUEST_MESSAGE, abort_unfittable,
                                                     retract_for_decode, stalled)
from kvstrata.engine.scheduler.prefill_step import PrefillStep
from kvstrata.engine.scheduler.stop_checker import StopChecker
from kvstrata.engine.scheduler.verify_step import (after_verified, clamp_computed,
                                                   collect_drafts, settle_verified)
from kvstrata.engine.sides.base import SchedulerSide
from kvstrata.engine.sides.registry import build_sides
from kvstrata.protocol import (FinishReason, NewRequestData, RunnerOutput, ScheduledRequest,
                               SchedulerOutput, TreeDraft)

__all__ = ["OOM_LAST_REQUEST_MESSAGE", "Scheduler", "SchedulerConfig"]


class Scheduler(PrefillStep):
    def __init__(self, config: SchedulerConfig, stop_checker: StopChecker):
        if config.schedule_policy not in ("fcfs", "lpm", "lof"):
            raise ValueError(f"--schedule-policy must be fcfs, lpm or lof, got "
                             f"{config.schedule_policy!r}")
        self.config = config
        self.page_size = config.page_size
        self.kv = KVManager(
            config.plan, not config.radix_cache, config.radix_eviction_policy,
            config.hicache_write_policy, config.prefetch_config(), config.backups_share_host,
            config.state_track_interval)
        self.stop_checker = stop_checker
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.chunked_req: Request | None = None
        # req_to_token rows 1..max_running_requests (row 0: the sink); enough for all.
        self.free_rows = list(range(1, config.max_running_requests + 1))
        self.num_rows = len(self.free_rows)
        self.freed_for_runner: list[str] = []
        self.finished_outside_step: list[Request] = []
        self.step_id = self.num_retractions = 0
        self.num_stalls = 0  # steps that had to abort a request that can never fit
        self._in_flight: dict[str, Request] = {}  # requests of the last SchedulerOutput
        # Verify entries of the last decode step: rid -> (start position, number of drafts).
        self._drafted: dict[str, tuple[int, int]] = {}
        # Plug-in sides (engine/sides/base.py), called at fixed points; never asked which exist.
        self.sides: list[SchedulerSide] = []
        build_sides(self)

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        # HiCache L3: fetch the prompt's stored pages while it queues (not for prompt
        # logprobs, computed anyway; nor where a side brings the KV: a PD decode server).
        if not req.return_prompt_logprobs and all(s.prefetches_storage(req) for s in self.sides):
            self.kv.start_prefetch(req)
        if not any(side.take(req) for side in self.sides):
            self.waiting.append(req)

    def validate(self, req: Request) -> str | None:
        """Why a side cannot serve this request (a 400 message), or None."""
        return next(filter(None, (side.validate(req) for side in self.sides)), None)

    def reject(self, req: Request) -> None:
        """A request refused before it was queued: the sides undo what peers wait for."""
        for side in self.sides:
            side.reject(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req
                    or self.kv.has_transfers_in_flight()
                    or any(side.has_work() for side in self.sides))

    def live_requests(self) -> list[Request]:
        live = list(self.running)
        if self.chunked_req is not None:
            live.append(self.chunked_req)
        return live

    def abort(self, rid: str, reason: FinishReason) -> Request | None:
        for side in self.sides:
            found = side.abort(rid, reason)
            if found is not None:
                return found
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return self.finish(req, reason)
        for req in self.live_requests():
            if req.rid == rid:
                if req is self.chunked_req:
                    self.chunked_req = None
                else:
                    self.running.remove(req)
                return self.finish(req, reason)
        return None

    # ---- the sides' facade (engine/scheduler/facade.py SchedulerFacade) ----
    def finish(self, req: Request, reason: FinishReason, *, release_kv: bool = True) -> Request:
        """The one end of every request the scheduler was given, whatever the path (stop,
        abort, out of memory, a failed transfer, a full queue, PD KV still in flight): mark
        it finished, release its KV and row, tell the runner to forget it, then every side's
        on_finish -- exactly once. `release_kv=False`: a side keeps the pages until a
        transfer that may still touch them ends (PD), and frees them itself."""
        if req.status is RequestStatus.FINISHED:
            raise AssertionError(f"{req.rid} ended twice ({req.finish_reason} then {reason})")
        req.finish_reason = reason
        req.status = RequestStatus.FINISHED
        # Ended while a verify ran (abort): only committed tokens' KV may reach the tree.
        clamp_computed(req)
        self.kv.abort_prefetch(req.rid)  # a prefetch still running for it is cancelled
        if release_kv and (req.row or req.pages or req.last_node is not None):
            self.kv.release(req, insert=True)
            self.free_row(req)
        self.forget_in_runner(req)
        for side in self.sides:
            side.on_finish(req)
        return req

    def finish_outside_step(self, req: Request, reason: FinishReason) -> None:
        """finish() for a request that produced no token this step (reported all the same)."""
        self.finished_outside_step.append(self.finish(req, reason))

    def free_row(self, req: Request) -> None:
        if req.row:
            self.free_rows.append(req.row)
            req.row = 0

    def forget_in_runner(self, req: Request) -> None:
        """The runner drops the request's state at the next step."""
        if req.known_to_runner:
            self.freed_for_runner.append(req.rid)
            req.known_to_runner = False

    def enqueue(self, req: Request) -> None:
        """A side hands a request to the waiting queue (prefill, with prefix matching)."""
        self.waiting.append(req)

    def drop_waiting(self, req: Request, reason: FinishReason) -> None:
        """End a request of the waiting queue (e.g. evicted from a full queue)."""
        self.waiting.remove(req)
        self.finish_outside_step(req, reason)

    def start_running(self, req: Request) -> bool:
        """A side's request whose KV is complete joins the decode batch, if a row is free
        and the batch has room."""
        if not self.free_rows or len(self.running) >= self.config.max_running_requests:
            return False
        req.row = self.free_rows.pop(0)
        req.row_stale_from = 0
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def stop_running(self, req: Request) -> None:
        """A side takes a running request out of the batch (its pages stay with it)."""
        self.running.remove(req)

    def count_retractions(self, retracted: int, remaining: list[Request]) -> None:
        self.num_retractions += retracted
        self.ratio.after_retraction(retracted, remaining)

    def reserved_tokens(self, req: Request) -> int:
        return self.ratio.reserved_tokens(req)

    def check_stop(self, req: Request) -> FinishReason | None:
        return self.stop_checker.check(req)

    def decode_pages_needed(self, reqs: list[Request], drafts: dict | None = None) -> int:
        return sum(self.kv.pages_needed(r, r.seq_len + len((drafts or {}).get(r.rid, ())))
                   for r in reqs)

    def make_room(self, req: Request, adder=None) -> bool:
        """Ask the sides to make room for `req` in a full batch (priority preemption)."""
        return any(side.make_room(req, adder) for side in self.sides)

    def preempt(self, victim: Request) -> None:
        """Out of the batch for a better one: a side's way (decode: KV backup), else recompute."""
        self.stop_running(victim)
        if not any(side.retract(victim) for side in self.sides):
            self.retract_one(victim)
            self.enqueue(victim)

    def retract_one(self, victim: Request) -> None:
        """Release a request's pages and row, and reset it to be computed again."""
        self.kv.release(victim, insert=False)
        self.free_row(victim)
        self.forget_in_runner(victim)
        victim.reset_for_retract()

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput | None:
        for side in self.sides:
            side.before_schedule()  # e.g. PD queues move on (bootstrap -> waiting, admission)
        for req in self.live_requests():  # hybrid SWA: windows moved on in the last step
            self.kv.free_out_of_window(req)
        out = self._schedule_prefill()
        if out is None and self.running:
            out = self._schedule_decode()
        if out is None and stalled(self):
            abort_unfittable(self)  # the progress guarantee (engine/scheduler/out_of_memory.py)
        if out is None and (self.freed_for_runner or self.kv.has_transfers_in_flight()
                            or any(side.needs_poll() for side in self.sides)):
            # No forward, but the runner must still forget requests / move or poll pages.
            out = self._output(False, [], [])
        return out

    def transfer_only_output(self) -> SchedulerOutput:
        """A step that computes nothing: the runner only moves pages and reports progress
        (a graceful shutdown draining storage backups)."""
        return self._output(False, [], [])

    def _output(self, is_prefill: bool, reqs: list[Request], scheduled: list[ScheduledRequest]):
        new = [
            NewRequestData(r.rid, r.prompt_ids, list(r.output_ids), r.params,
                           r.return_prompt_logprobs and r.retraction_count == 0,
                           dsa_seed=r.dsa_seed_positions, spec_handoff=r.spec_handoff)
            for r in reqs if not r.known_to_runner
        ]
        for r in reqs:
            if not r.known_to_runner:  # the PD seed / draft state feed one first step only:
                r.dsa_seed_positions = r.spec_handoff = None  # a restore never resends them
            r.known_to_runner = True
        self._in_flight = {r.rid: r for r in reqs}
        if not scheduled or is_prefill:
            self._drafted = {}
        freed, self.freed_for_runner = self.freed_for_runner, []
        self.step_id += 1
        ops = self.kv.drain_ops()
        for side in self.sides:
            ops += side.drain_ops()
        return SchedulerOutput(self.step_id, is_prefill, new, scheduled, freed, ops=ops)

    def _entry(self, req: Request, num_tokens: int, sample: bool,
               draft: list[int] = ()) -> ScheduledRequest:
        start = req.num_computed_tokens
        write_from = min(req.row_stale_from, start)
        end = start + num_tokens + len(draft)
        entry = ScheduledRequest(
            rid=req.rid, row=req.row, start_pos=start,
            token_ids=req.all_ids[start:start + num_tokens] + list(draft),
            slot_write_start=write_from,
            slots=self.kv.slots(req, write_from, end),
            swa_slots=self.kv.swa_slots(req, write_from, end),
            sample=sample, num_draft=len(draft),
            draft_parents=getattr(draft, "parents", None),
            runner_tree=isinstance(draft, TreeDraft) and draft.parents is None,
            **self.kv.state_fields(req, end, chunk_end=not sample, num_draft=len(draft)),
        )
        # Optimistic: run before the next schedule() (a verify entry is corrected in update).
        req.num_computed_tokens = end
        req.row_stale_from = req.num_computed_tokens
        return entry

    def _schedule_decode(self) -> SchedulerOutput | None:
        drafts = collect_drafts(self)
        speculating = drafts is not None
        if drafts and not self.kv.ensure_free_pages(self.decode_pages_needed(self.running,
                                                                             drafts)):
            drafts = {}  # speculation never costs a retraction: plain decode when short
        drafts = drafts or {}
        if not self.kv.ensure_free_pages(self.decode_pages_needed(self.running)):
            if self.kv.copies_pin_pages():
                # HiCache writes pin tree pages until they finish; wait for them (an idle
                # step that blocks on the copy) before retracting or aborting anyone.
                return None
            if not any(side.on_decode_oom() for side in self.sides):  # a side's own way
                retract_for_decode(self)  # first, else recompute-retraction
            if not self.running:
                return self._output(False, [], []) if self.freed_for_runner else None
        else:
            self.ratio.on_decode_step()
        scheduled = []
        self._drafted = {}
        for req in self.running:
            draft = drafts.get(req.rid, [])
            ok = self.kv.grow(req, req.seq_len + len(draft))
            assert ok, "decode pages were checked above"
            if speculating:  # every decode entry is a verify pass, of 0 drafts or more
                self._drafted[req.rid] = (req.num_computed_tokens, len(draft))
            scheduled.append(self._entry(req, 1, sample=True, draft=draft))
        return self._output(False, list(self.running), scheduled)

    # ------------------------------------------------------------------ results
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply sampled tokens; returns the requests that produced output this step."""
        self.kv.on_events(result.events)
        self.kv.after_forward()  # recurrent state: the snapshots copied from may go
        by_id = {rid: r for rid, r in self._in_flight.items() if not r.is_finished}
        touched: list[Request] = []
        for rid, logprobs in result.prompt_logprobs.items():
            if rid in by_id:
                by_id[rid].prompt_logprobs = logprobs
                by_id[rid].prompt_top_logprobs = result.prompt_top_logprobs.get(rid)
        produced = settle_verified(self._drafted, by_id, result.rids)
        for i, (rid, token) in enumerate(zip(result.rids, result.token_ids)):
            req = by_id.get(rid)
            if req is None or req.is_finished:
                continue  # aborted while the forward ran, or stopped inside a verified run
            if any(side.on_token(req, token, result.logprobs[i], result.top_logprobs[i],
                                 result) for side in self.sides):
                continue  # e.g. a PD prefill server sends the token, never decodes
            if req.params.max_new_tokens == 0:
                self._complete(req, FinishReason(type="length"))  # prefill-only (scoring)
                touched.append(req)
                continue
            req.output_ids.append(token)
            if result.logprobs[i] is not None:
                req.pending_logprobs.append(result.logprobs[i])
                req.pending_top_logprobs.append(result.top_logprobs[i] or [])
            if req.status is RequestStatus.RUNNING and req not in self.running:
                self.running.append(req)  # its prefill is done: hybrid SWA caches the prompt
                self.kv.cache_prompt(req)
            reason = self.stop_checker.check(req)
            if reason is not None:
                self._complete(req, reason)
            if not touched or touched[-1] is not req:  # a verified run: one entry
                touched.append(req)
        after_verified(self, self._drafted, by_id, produced)
        if self.chunked_req is not None:
            self.kv.cache_unfinished(self.chunked_req)
            for side in self.sides:
                side.after_chunk(self.chunked_req)
        for side in self.sides:
            touched += side.on_runner_output(result)
        return touched

    def _complete(self, req: Request, reason: FinishReason) -> None:
        # A stop inside a verified run: every committed token's KV is computed.
        clamp_computed(req)
        if req in self.running:
            self.running.remove(req)
        self.finish(req, reason)

