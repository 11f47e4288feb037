"""The engine core: scheduler + runner in one loop step (no torch here; the runner is
injected). Used in-process by `kvstrata.LLM` and inside the scheduler process by the server.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from kvstrata import envs
from kvstrata.cache.invariants import expected_rows, expected_state_slots, expected_swa_rows
from kvstrata.engine.request import EngineRequest, Request
from kvstrata.engine.scheduler.core import Scheduler, SchedulerConfig
from kvstrata.engine.scheduler.introspect import check_scheduler, dump_state
from kvstrata.engine.scheduler.stop_checker import StopChecker
from kvstrata.engine.sides.priority import resolve_priority
from kvstrata.engine.sides.registry import spec_side
from kvstrata.protocol import FinishReason, RequestOutput, SpecCounts

logger = logging.getLogger(__name__)
# A graceful shutdown waits this long for host writes and their storage backups (HiCache L3):
# under the launcher's 10 s join of the scheduler process (launcher.JOIN_TIMEOUT_S).
BACKUP_DRAIN_SECONDS = 6.0


class EngineCore:
    def __init__(self, runner: Any, config: SchedulerConfig, tokenizer: Any = None):
        """`runner` needs: execute(SchedulerOutput) -> RunnerOutput, eos_token_ids,
        max_context_len, vocab_size."""
        self.runner = runner
        self.kv_plan = config.plan  # the one KV geometry/capacity (shown by /server_info)
        self.max_context_len = runner.max_context_len
        self.vocab_size = runner.vocab_size
        self.scheduler = Scheduler(
            config, StopChecker(list(runner.eos_token_ids), runner.max_context_len, tokenizer))
        # Emit a request's tokens every `stream_interval` tokens (the first token and the
        # finish are always emitted at once): fewer, larger messages for the server.
        self.stream_interval = 1
        self._arrivals = 0
        self._rejected: list[Request] = []
        self._rids: set[str] = set()
        self.speculating = spec_side(self.scheduler) is not None
        # KVSTRATA_CHECK_INTEGRITY=1: every invariant after every step (the test suite runs so).
        self.check_every_step = envs.KVSTRATA_CHECK_INTEGRITY.get()

    # ------------------------------------------------------------------ requests
    def add_request(self, er: EngineRequest) -> None:
        """Never raises for bad input: the request finishes with an abort (status 400)."""
        req = Request(er.rid, list(er.prompt_ids), er.sampling_params, self._arrivals,
                      er.return_prompt_logprobs, bootstrap=er.bootstrap,
                      cache_salt=er.cache_salt or None)
        self._arrivals += 1
        req.priority, refused = resolve_priority(self.scheduler.config, er.priority)
        error = refused or self._validate(req)
        if error is not None:
            req.finish_reason = FinishReason(type="abort", message=error,
                                             status_code=503 if refused else 400)
            self._rejected.append(req)
            self.scheduler.reject(req)  # e.g. PD: the peer server fails its half now
            return
        self._rids.add(req.rid)
        self.scheduler.add(req)

    def _validate(self, req: Request) -> str | None:
        n = len(req.prompt_ids)
        if req.rid in self._rids:
            return f"Duplicate request id {req.rid!r}."
        if n == 0:
            return "The prompt is empty."
        if any(not (0 <= t < self.vocab_size) for t in req.prompt_ids):
            return f"Token ids must be in [0, {self.vocab_size})."
        if n >= self.max_context_len:
            return (f"The input ({n} tokens) is longer than the model's context length "
                    f"({self.max_context_len} tokens).")
        if n + 1 > self.scheduler.kv.total_tokens:
            return (f"The input ({n} tokens) does not fit in the KV cache "
                    f"({self.scheduler.kv.total_tokens} tokens); raise --max-total-tokens.")
        swa = self.scheduler.kv.swa
        if swa is not None and swa.lone_request_tokens(n) > swa.allocator.num_pages * swa.page_size:
            return (f"The input ({n} tokens) does not fit in the sliding-window KV pool "
                    f"({swa.allocator.num_pages * swa.page_size} tokens): it needs "
                    f"{swa.lone_request_tokens(n)} at once (the window of {swa.window} tokens "
                    f"plus the pages being written); raise --swa-full-tokens-ratio or "
                    f"--max-total-tokens.")
        return self.scheduler.validate(req)  # e.g. PD: bootstrap info, room not in use

    def abort_request(self, rid: str) -> None:
        req = self.scheduler.abort(rid, FinishReason(type="abort", message="Aborted by the client.",
                                                     status_code=499))
        if req is not None:
            self.scheduler.finished_outside_step.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self._rejected or self.scheduler.has_work()
                    or self.scheduler.finished_outside_step)

    # ------------------------------------------------------------------ the loop step
    def step(self) -> list[RequestOutput]:
        outputs = [self._output(r) for r in self._drain_rejected()]
        sched_out = self.scheduler.schedule()
        touched: list[Request] = []
        if sched_out is not None:
            result = self.runner.execute(sched_out)
            touched = self.scheduler.update(sched_out, result)
            for rid, message in result.grammar_errors.items():
                self._grammar_failed(rid, message, touched)
        touched += self.scheduler.finished_outside_step
        self.scheduler.finished_outside_step = []
        if self.check_every_step:
            self.check_integrity()
        for req in touched:
            pending = len(req.output_ids) - req.num_reported_tokens
            if not (req.is_finished or len(req.output_ids) == 1
                    or pending >= (req.params.stream_interval or self.stream_interval)):
                continue
            outputs.append(self._output(req))
            if req.is_finished:
                self._rids.discard(req.rid)
        return outputs

    def _grammar_failed(self, rid: str, message: str, touched: list[Request]) -> None:
        """A request whose grammar failed in the runner drew an EOS (all a failed matcher
        allows): its finish becomes an abort with llguidance's message, as a grammar refused
        up front is (SGLang aborts a request whose grammar fails to compile)."""
        reason = FinishReason(type="abort", message=message, status_code=400)
        done = next((r for r in touched if r.rid == rid and r.is_finished), None)
        if done is not None:
            done.finish_reason = reason
            return
        req = self.scheduler.abort(rid, reason)  # ignore_eos kept it running
        if req is not None:
            touched.append(req)

    def _drain_rejected(self) -> list[Request]:
        rejected, self._rejected = self._rejected, []
        return rejected

    def _output(self, req: Request) -> RequestOutput:
        new_ids = req.output_ids[req.num_reported_tokens:]
        req.num_reported_tokens = len(req.output_ids)
        logprobs = top = None
        if req.params.logprobs is not None:
            logprobs, req.pending_logprobs = req.pending_logprobs, []
            top = [list(row) for row in req.pending_top_logprobs]
            req.pending_top_logprobs = []
        prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
        prompt_top, req.prompt_top_logprobs = req.prompt_top_logprobs, None
        return RequestOutput(
            rid=req.rid, new_token_ids=new_ids, finished=req.is_finished,
            finish_reason=req.finish_reason, prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
            new_logprobs=logprobs, new_top_logprobs=top, prompt_logprobs=prompt_logprobs,
            prompt_top_logprobs=prompt_top,
            spec=SpecCounts(req.spec_verify_ct, req.spec_draft_tokens,
                            req.spec_accepted_drafts) if self.speculating else None,
        )

    # ------------------------------------------------------------------ admin
    def flush_cache(self) -> bool:
        if self.scheduler.has_work():
            return False
        return self.scheduler.kv.flush()

    def get_load(self) -> dict:
        kv = self.scheduler.kv
        used = kv.used_tokens()
        return {
            "num_running_reqs": len(self.scheduler.live_requests()),
            "num_waiting_reqs": len(self.scheduler.waiting),
            "num_used_tokens": used,
            "max_total_num_tokens": kv.total_tokens,
            "token_usage": used / kv.total_tokens if kv.total_tokens else 0.0,
            "num_cached_tokens": kv.tree.cached_pages() * kv.page_size,
            "cache_hit_rate": kv.hit_rate(),
            "num_retractions": self.scheduler.num_retractions,
            "new_token_ratio": self.scheduler.ratio.value,
            **self._hicache_load(),
            **self._swa_load(),
            **self._state_load(),
            **{k: v for side in self.scheduler.sides for k, v in side.load().items()},
        }

    def _swa_load(self) -> dict:
        """Hybrid SWA memory: the SWA pool's usage beside the full pool's (SGLang's
        swa_token_usage), counted like num_used_tokens: held by requests or SWA-locked in the
        tree (SWA pages cached but evictable are free to take)."""
        kv = self.scheduler.kv
        if kv.swa is None:
            return {}
        total = kv.swa.allocator.num_pages * kv.page_size
        used = (kv.swa.allocator.num_used() - kv.tree.evictable_swa_pages()) * kv.page_size
        return {"num_used_swa_tokens": used, "max_total_swa_tokens": total,
                "swa_token_usage": used / total if total else 0.0}

    def _state_load(self) -> dict:
        """Recurrent state: slots held by requests or pinned for a copy (cached snapshots
        can be evicted: free to take), the pool, and the snapshots cached."""
        kv = self.scheduler.kv
        if kv.states is None:
            return {}
        total = kv.states.num_slots
        used = kv.states.allocator.num_used() - kv.tree.cached_states() + kv.tree.pinned_states()
        return {"num_used_state_slots": used, "max_state_slots": total,
                "state_slot_usage": used / total, "num_cached_states": kv.tree.cached_states()}

    def _hicache_load(self) -> dict:
        kv = self.scheduler.kv
        if not kv.hicache:
            return {}
        st = kv.tree.stats
        P = kv.page_size
        out = {
            "hicache_device_hit_tokens": kv.matched_tokens - st.host_hit_tokens,
            "hicache_host_hit_tokens": st.host_hit_tokens,
            "hicache_d2h_pages": st.d2h_pages,
            "hicache_h2d_pages": st.h2d_pages,
            "hicache_demoted_pages": st.demoted_pages,
            "hicache_failed_jobs": st.failed_jobs,
            "hicache_host_total_tokens": kv.host_allocator.num_pages * P,
            "hicache_host_used_tokens": kv.host_allocator.num_used() * P,
            # host writes / loads / L3 backups still running: an async write locks its node's
            # device pages until it ends, so a drained server's num_used_tokens is final
            # only once this is False (tests wait for it: tests/e2e/pd_servers.py)
            "hicache_busy": kv.has_transfers_in_flight(),
        }
        if kv.swa is not None:  # device tombstones whose window came back from the host
            out["hicache_swa_revived_pages"] = kv.tree.swa_revived_pages
        if kv.states is not None:  # host copies of state snapshots (cache/state_hiradix.py)
            out.update({"hicache_host_state_slots": kv.tree.host_slots.num_pages,
                        "hicache_host_cached_states": kv.tree.cached_host_states(),
                        "hicache_states_to_host": kv.tree.states_to_host,
                        "hicache_states_from_host": kv.tree.states_from_host})
        if kv.storage is not None:  # L3: tokens per outcome (the runner adds bytes)
            out.update({f"hicache_storage_{k}": v
                        for k, v in dataclasses.asdict(kv.storage.stats).items()})
        stats = getattr(self.runner, "transfer_stats", None)
        if stats is not None:
            out.update({f"hicache_{k}": v for k, v in stats().items()})
        return out

    def check_integrity(self) -> None:
        """Every KV invariant, including the runner's req_to_token rows when it can tell."""
        check_scheduler(self.scheduler)
        check_rows = getattr(self.runner, "check_req_to_token", None)
        if check_rows is not None:
            live = self.scheduler.live_requests()
            check_rows(expected_rows(live, self.scheduler.page_size),
                       expected_swa_rows(live, self.scheduler.kv.swa))
        check_states = getattr(self.runner, "check_state_slots", None)
        if check_states is not None and self.scheduler.kv.states is not None:
            check_states(expected_state_slots(self.scheduler.kv, self.scheduler.live_requests()))

    def dump_state(self) -> str:
        return dump_state(self.scheduler)

    def finish_storage_backups(self, timeout: float = BACKUP_DRAIN_SECONDS) -> bool:
        """Graceful shutdown with HiCache L3: step transfers only (no forward) until every
        host write and its storage backup has ended, so the next server finds the pages.
        Bounded by `timeout` (logged when hit). True when nothing is left pending."""
        kv = self.scheduler.kv
        deadline = time.monotonic() + timeout
        while kv.storage_backups_pending():
            if time.monotonic() >= deadline:
                logger.warning("Shutdown: storage backups still pending after %.1f s; stopping "
                               "without them", timeout)
                return False
            out = self.scheduler.transfer_only_output()
            self.scheduler.update(out, self.runner.execute(out))
        return True

    def shutdown(self) -> None:
        if self.scheduler.kv.storage is not None:
            self.finish_storage_backups()
        close = getattr(self.runner, "shutdown", None)
        if close is not None:
            close()
