"""The scheduler's prefill step (no torch): which waiting requests join this step's prefill
batch -- the chunked request first, then candidates in policy order while the token budgets
(prefill_adder.py), the batch, the free rows, a storage prefetch and the KV pool allow --,
each admitted one matched against the prefix cache, given its pages and a row, and the
batch's entries. A mixin of Scheduler (core.py): it reads its queues, KV manager and sides,
and builds entries with its `_entry` / `_output`.
"""
from __future__ import annotations

from kvstrata.engine.request import Request, RequestStatus
from kvstrata.engine.scheduler.prefill_adder import (PrefillAdder, PrefillItem, branch_cap,
                                                     prefill_candidates, swa_budget)
from kvstrata.protocol import SchedulerOutput


class PrefillStep:
    def _schedule_prefill(self) -> SchedulerOutput | None:
        if not self.waiting and self.chunked_req is None:
            return None
        cfg = self.config
        reserved = sum(self.ratio.reserved_tokens(r) for r in self.running)
        chunk = cfg.chunked_prefill_size if cfg.chunked_prefill_size and cfg.chunked_prefill_size > 0 else None
        adder = PrefillAdder(
            page_size=self.page_size,
            rem_total=self.kv.full_allocatable_tokens() - reserved,
            rem_input=cfg.max_prefill_tokens, rem_chunk=chunk,
            running_empty=not self.running and self.chunked_req is None,
            **swa_budget(self),
        )
        if self.chunked_req is not None:
            req = self.chunked_req
            item = adder.add_chunked(req, req.seq_len - req.num_computed_tokens, branch_cap(req))
            if item is not None and not self.kv.grow(req, req.num_computed_tokens + item.extend_len):
                adder.items.remove(item)
                item = None
            if item is None:
                # Blocked: the running requests hold the memory. Decode goes on (they finish
                # or retraction takes this request); admitting others would starve it.
                return None
        for req in prefill_candidates(self):
            full = len(self.running) + len(adder.items) >= cfg.max_running_requests
            if (full or not self.free_rows) and not self.make_room(req, adder):
                break  # a side may make room: priority preemption (engine/sides/priority.py)
            if not self.kv.prefetch_ready(req):
                continue  # its storage prefetch policy holds it in the queue (SGLang)
            if not self._admit(req, adder):
                break
        if not adder.items:
            return None
        return self._build_prefill(adder.items)

    def _admit(self, req: Request, adder: PrefillAdder) -> bool:
        # Prompt logprobs (echo) need the logits of every prompt position: no prefix reuse.
        wants_prompt_logprobs = req.return_prompt_logprobs and req.retraction_count == 0
        use_cache = not wants_prompt_logprobs
        # Dry run before matching: a HiCache match loads host pages back at once, and a
        # load for a request that is then refused is a copy per step for nothing (it also
        # kept decode waiting on copies forever). The device prefix, once locked, leaves the
        # evictable budget: count all of it (conservative only when another request already
        # pins part of it, i.e. when something runs).
        device_prefix = self.kv.peek_prefix_len(req.all_ids, salt=req.cache_salt) \
            if use_cache else 0
        if not adder.fits(req, req.seq_len - device_prefix, device_prefix):
            return False
        protected_before = self.kv.tree.protected_pages()
        swa_before = self.kv.swa_allocatable_tokens()
        prefix = self.kv.match_and_lock(req, use_cache=use_cache)
        # Pinning the matched prefix takes it out of the evictable budget.
        adder.rem_total -= (self.kv.tree.protected_pages() - protected_before) * self.page_size
        if swa_before is not None:  # and its last window out of the SWA one
            adder.rem_swa -= swa_before - self.kv.swa_allocatable_tokens()
        item = adder.try_add(req, req.seq_len - prefix, branch_cap(req))
        # (recurrent state: a working slot too; none free even after evicting snapshots
        # means every slot is held by running requests: wait for one to end)
        if item is None or not self.kv.grow(req, prefix + item.extend_len) \
                or not self.kv.assign_state_slot(req):
            if item is not None:
                adder.items.remove(item)
            self.kv.release(req, insert=False)
            req.num_computed_tokens = 0
            return False
        self.waiting.remove(req)
        req.row = self.free_rows.pop(0)
        req.row_stale_from = 0
        req.cached_tokens += prefix
        req.status = RequestStatus.RUNNING
        return True

    def _build_prefill(self, items: list[PrefillItem]) -> SchedulerOutput:
        scheduled = []
        for item in items:
            scheduled.append(self._entry(item.req, item.extend_len, sample=item.is_last_chunk))
            if item.is_last_chunk:
                if item.req is self.chunked_req:
                    self.chunked_req = None
            else:
                assert self.chunked_req in (None, item.req), "two chunked requests"
                self.chunked_req = item.req
        return self._output(True, [i.req for i in items], scheduled)
