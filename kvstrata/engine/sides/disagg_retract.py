"""Decode retraction with a KV backup (SGLang's decode retraction; no torch).

A decode server never ran a request's prompt (the prefill server did), so it cannot
recompute-retract. When the running batch cannot get its next pages it retracts in SGLang's
order (fewest generated tokens first, ties: longest prompt; never the last running request;
then the new_token_ratio re-estimate), but each victim's KV is *backed up* first:
  backup   `seq_len - 1` tokens (every layer) -> the backup, via a BackupOp the runner
           applies first in the next SchedulerOutput (before the PD ops and the forward, so
           the freed device pages may go to another request in that same step). Backends:
           cpu_tensor (CPU tensors the runner keeps under the rid; always succeeds) or
           host_pool (host pages of the retraction host pool, allocated here). A host pool
           that cannot hold the backup aborts that request only: EXHAUSTED_MESSAGE, 500.
           Then its device pages and row are freed and it enters the retracted queue.
           With recurrent state the request's state slot is copied out too (BackupOp
           .state_slot: a CPU copy with either backend, SGLang's cpu_tensor path keeps the
           mamba slot beside the KV) and freed with its pages.
  resume   before any admission, each step, in order: stop at the first request for which
           no request slot is free (max_running_requests + extra slots hold decode KV) or
           pages(seq_len - 1) + num_reserved_decode_tokens exceeds the admission budget
           (when nothing holds decode KV, its pages being free is enough); else allocate its
           pages (and a state slot), emit `restore`, and hand it to the prebuilt queue as if
           its transfer had just finished: num_computed_tokens = seq_len - 1,
           row_stale_from = 0, so its next decode step feeds the last output token at
           position seq_len - 1 and writes the whole req_to_token row (no forward over the
           prompt, no re-transfer).
  discard  a retracted request that is aborted drops its backup (host pages freed); once.
While the retracted queue is not empty no new request is admitted.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.cache.swa_pd import grow_swa_tail, tail_start_page
from kvstrata.engine.request import Request, RequestStatus
from kvstrata.protocol import FinishReason
from kvstrata.protocol.disagg import BackupOp

if TYPE_CHECKING:  # annotations only: no import circle
    from kvstrata.engine.sides.disagg_decode import DecodeDisagg

logger = logging.getLogger(__name__)

EXHAUSTED_MESSAGE = "Retraction host KV pool exhausted. Aborting the request."
OOM_LAST_MESSAGE = ("Out of memory even after retracting all other requests in the decode "
                    "batch. Aborting the last request.")
BACKENDS = ("cpu_tensor", "host_pool")


@dataclass
class Backup:
    num_tokens: int
    num_pages: int
    host_pages: list[int] = field(default_factory=list)  # host_pool only


class DecodeRetraction:
    """Owned by DecodeDisagg: the retracted queue, the backups and their BackupOps."""

    def __init__(self, side: DecodeDisagg, backend: str):
        if backend not in BACKENDS:
            raise ValueError(f"unknown retraction backup backend {backend!r}")
        self.side = side
        self.sched = side.sched
        self.kv = side.kv
        self.backend = backend
        self.retracted: list[Request] = []
        self.backups: dict[str, Backup] = {}
        self.ops: list[BackupOp] = []
        self.num_retractions = 0
        self.num_preempted = 0  # of which priority preemptions (not counted as retractions)
        self.num_backups = dict.fromkeys(BACKENDS, 0)
        self.num_restores = dict.fromkeys(BACKENDS, 0)
        self.backup_bytes = 0
        self.exhausted_aborts = 0

    def drain_ops(self) -> list[BackupOp]:
        ops, self.ops = self.ops, []
        return ops

    # ------------------------------------------------------------------ retraction
    def on_decode_oom(self) -> None:
        """The running batch cannot get its next pages (no tree to evict on a decode server).
        Retract (back up) running requests, fewest generated tokens first, ties: longest
        prompt, until the rest fits; never the last one. If one alone still does not fit,
        requests that hold transferred KV but wait for a row (prebuilt) are backed up too;
        then the last running request is aborted (SGLang's 500)."""
        sched, kv = self.sched, self.kv
        remaining = sorted(sched.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)),
                           reverse=True)  # pop() yields the next victim

        def fits() -> bool:
            return kv.ensure_free_pages(sched.decode_pages_needed(remaining))

        retracted: list[Request] = []
        while len(remaining) > 1 and not fits():
            victim = remaining.pop()
            sched.stop_running(victim)
            if self._retract(victim):
                retracted.append(victim)
        prebuilt = self.side.prebuilt
        while remaining and prebuilt and not fits():
            victim = prebuilt.pop()  # the most recently queued first
            if self._retract(victim):
                retracted.append(victim)
        if remaining and not fits():
            last = remaining.pop()
            sched.stop_running(last)
            sched.finish_outside_step(last, FinishReason(
                type="abort", message=OOM_LAST_MESSAGE, status_code=500))
        self.num_retractions += len(retracted)
        sched.count_retractions(len(retracted), remaining)

    def preempt(self, req: Request) -> None:
        """Priority preemption of a running request (out of the batch already): backed up
        and queued for resume as a retracted request (aborted if the host pool is full)."""
        if self._retract(req):
            self.num_preempted += 1

    def _retract(self, req: Request) -> bool:
        """Back up `req`'s KV, free its device pages and row, queue it. False when the host
        pool cannot hold the backup: the request is aborted instead (pages freed too)."""
        tokens = req.seq_len - 1
        num_pages = self.side.pages_for(tokens)
        assert tokens >= 1 and len(req.pages) >= num_pages, (req.rid, tokens, req.pages)
        host: list[int] = []
        if self.backend == "host_pool":
            # SGLang reclaims evictable host pages first; a retraction-only host pool has no
            # radix tree behind it, so there is nothing to evict (kv.alloc_backup_pages).
            host = self.kv.alloc_backup_pages(num_pages)
            if host is None:
                self.exhausted_aborts += 1
                logger.warning("decode retraction of %s: the retraction host KV pool cannot "
                               "hold %d pages; aborting it", req.rid, num_pages)
                self.sched.finish_outside_step(req, FinishReason(
                    type="abort", message=EXHAUSTED_MESSAGE, status_code=500))
                return False
        self.ops.append(BackupOp(kind="backup", rid=req.rid, backend=self.backend,
                                 num_tokens=tokens, device_pages=req.pages[:num_pages],
                                 host_pages=list(host),
                                 swa_pages=self._window_swa_pages(req, tokens),
                                 state_slot=req.state_slot))
        self.backups[req.rid] = Backup(tokens, num_pages, list(host))
        self.num_backups[self.backend] += 1
        plan = self.kv.plan
        self.backup_bytes += tokens * plan.bytes_per_token + (
            plan.state_bytes_per_slot if plan.has_state_pool else 0)
        # The device pages go back only after the backup op is queued: it ships, and is
        # applied first, in the same SchedulerOutput as any op that reuses them.
        self.sched.retract_one(req)  # release pages + row, the runner forgets it
        self.retracted.append(req)
        return True

    def _window_swa_pages(self, req: Request, tokens: int) -> list[int]:
        """The SWA pages of the window the next query (at `tokens`) reads: what a backup
        keeps beside the full pages ([] without an SWA pool). Live: the request frees only
        pages a whole window and a page behind its computed tokens (cache/swa_pages.py)."""
        swa = self.kv.swa
        if swa is None:
            return []
        first = tail_start_page(tokens, swa.window, self.side.page_size)
        pages = [swa.map[p] for p in req.pages[first:self.side.pages_for(tokens)]]
        assert all(pages), f"{req.rid}: a page of its last window has no SWA page"
        return pages

    # ------------------------------------------------------------------ resume
    def resume(self) -> None:
        """SGLang's resume_retracted_reqs: in order, while a slot and the budget allow."""
        if not self.retracted:
            return
        side = self.side
        allocatable, _ = side.budget()
        P = side.page_size
        swa_spent = 0
        for req in list(self.retracted):
            if side.holding() >= side.max_holding:
                break
            backup = self.backups[req.rid]
            need = backup.num_pages * P
            idle = not side.holding() and not side.frees_memory_later()
            fits = need + side.reserved <= allocatable
            if not (fits or (idle and need <= side.full_allocatable())):
                break
            if not side.swa_fits(backup.num_tokens, swa_spent):
                break
            # hybrid SWA memory: SWA pages for the backed-up window only, as at admission
            grown = grow_swa_tail(self.kv, req, backup.num_tokens) \
                if self.kv.swa is not None else self.kv.grow(req, backup.num_tokens)
            # recurrent state: a new slot for the backed-up state
            if not grown or not self.kv.assign_state_slot(req):
                self.kv.release(req, insert=False)
                break
            swa_spent += side.swa_tail_pages(backup.num_tokens) * P
            allocatable -= need + side.reserved
            self.retracted.remove(req)
            self._restore(req, backup)

    def _restore(self, req: Request, backup: Backup) -> None:
        del self.backups[req.rid]
        self.ops.append(BackupOp(kind="restore", rid=req.rid, backend=self.backend,
                                 num_tokens=backup.num_tokens, device_pages=list(req.pages),
                                 host_pages=list(backup.host_pages),
                                 swa_pages=self._window_swa_pages(req, backup.num_tokens),
                                 state_slot=req.state_slot))
        if backup.host_pages:
            # Freed now: the restore reads them first in the next SchedulerOutput, before
            # any later backup can write them.
            self.kv.free_backup_pages(backup.host_pages)
        self.num_restores[self.backend] += 1
        # The prebuilt path, as after a transfer: the KV of [0, seq_len - 1) is present;
        # the last output token is the next decode input.
        req.num_computed_tokens = backup.num_tokens
        req.row_stale_from = 0
        req.status = RequestStatus.WAITING
        self.side.prebuilt.append(req)

    # ------------------------------------------------------------------ abort
    def discard(self, req: Request) -> None:
        """Drop the backup of a request that ends while retracted (idempotent)."""
        backup = self.backups.pop(req.rid, None)
        if req in self.retracted:
            self.retracted.remove(req)
        if backup is None:
            return
        self.ops.append(BackupOp(kind="discard", rid=req.rid, backend=self.backend,
                                 num_tokens=backup.num_tokens,
                                 host_pages=list(backup.host_pages)))
        if backup.host_pages:
            self.kv.free_backup_pages(backup.host_pages)

    # ------------------------------------------------------------------ introspection
    def load(self) -> dict:
        out = {"decode_retraction_backup": self.backend,
               "decode_retractions_total": self.num_retractions,
               "decode_priority_preemptions": self.num_preempted}
        for backend in BACKENDS:
            out[f"decode_backups_{backend}"] = self.num_backups[backend]
            out[f"decode_restores_{backend}"] = self.num_restores[backend]
        out["decode_backup_bytes"] = self.backup_bytes
        out["decode_backup_exhausted_aborts"] = self.exhausted_aborts
        if self.kv.backup_pool:
            P = self.page_size
            out["decode_backup_host_total_tokens"] = self.kv.host_allocator.num_pages * P
            out["decode_backup_host_used_tokens"] = self.kv.host_allocator.num_used() * P
        return out

    @property
    def page_size(self) -> int:
        return self.side.page_size

    def dump_line(self) -> str:
        held = sum(len(b.host_pages) for b in self.backups.values())
        return (f"retraction ({self.backend}): retracted {len(self.retracted)}, backups "
                f"{len(self.backups)} (host pages {held}), ops pending {len(self.ops)}")

    def check(self) -> None:
        """Every retracted request has exactly one backup and holds no device KV or row;
        every backup belongs to a retracted request; host pages: free + backed up == total."""
        rids = [r.rid for r in self.retracted]
        assert sorted(rids) == sorted(self.backups), (
            f"retracted {sorted(rids)} != backups {sorted(self.backups)}")
        for req in self.retracted:
            assert not req.pages and not req.row and req.last_node is None, (
                f"{req.rid}: retracted but holds KV or a row")
            assert not req.is_finished, f"{req.rid}: finished but still retracted"
            assert self.backups[req.rid].num_tokens == req.seq_len - 1, (
                f"{req.rid}: backup of {self.backups[req.rid].num_tokens} tokens, "
                f"seq_len {req.seq_len}")
        if self.backend == "cpu_tensor":
            assert not any(b.host_pages for b in self.backups.values())
        self.kv.check_backups([b.host_pages for b in self.backups.values()])
