"""ModelRunner's executor half (runner/model_runner.py is the forward half): which executors
the runner built, one step's ops through them around the forward, the PD transfer manager and
HiCache L3 switched on after allocate_kv, and the ordered shutdown. A mixin: it reads the
runner's pools, plan and draft, and calls its `_execute_forward`.
"""
from __future__ import annotations

from kvstrata.protocol.disagg import BackupOp
from kvstrata.protocol.scheduler_output import RunnerOutput, SchedulerOutput
from kvstrata.runner.executors.base import OpExecutor, split_ops
from kvstrata.runner.executors.registry import EXECUTORS
from kvstrata.runner.executors.retraction_backup import on_demand_backup, with_swa_pool


class ExecutorWiring:
    def executors(self) -> list[OpExecutor]:
        """The executors this runner built, in the registry's order (runner/executors/
        registry.py: retraction backups, tier moves, PD ops); each lives in the attribute the
        registry names."""
        return [ex for ex in (getattr(self, name) for name in EXECUTORS) if ex is not None]

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """The step's ops go to their executors (runner/executors/base.py) in registry
        order; then the forward; then every executor reports its events."""
        if self.backup is None and any(isinstance(op, BackupOp) for op in sched.ops):
            self.backup = with_swa_pool(
                on_demand_backup(self.kv_pool, self.hicache, self.state_pool), self.swa_pool,
                self.hicache.swa_host_pool if self.hicache is not None else None,
                self.plan.io_backend)
        executors = self.executors()
        if self.draft is not None:
            self.draft.on_copies(sched.ops)
        idle = not sched.scheduled
        events: list = []
        for ex, ops in zip(executors, split_ops(sched.ops, executors)):
            events += ex.apply_ops(ops, idle)
        out = self._execute_forward(sched)
        for ex in executors:
            events += ex.poll_events(idle)
        out.events = events
        return out

    def enable_disagg(self, role: str, backend: str, host: str, bootstrap_port: int,
                      num_metadata_slots: int, tp: tuple[int, int] = (0, 1)) -> None:
        """PD: build the transfer manager over the device pool (after allocate_kv); the
        prefill role starts its bootstrap server on host:bootstrap_port (tp rank 0)."""
        if self.plan is None:
            raise RuntimeError("enable_disagg() needs the KV pool: call allocate_kv() first")
        from kvstrata.kv.device_pool import page_buffers_of
        from kvstrata.runner.executors.disagg import DisaggExecutor
        from kvstrata.transfer.disagg.registry import create_manager
        self.pd_role = role
        # an all-SWA model's missing full pool: a region of zero-byte pages (its SWA pages are
        # the second region); a model without K/V (Mamba2) has only its state pool's buffers
        main = [] if self.kv_pool is None and self.swa_pool is None else \
            page_buffers_of(self.kv_pool, self.plan.num_pages)
        buffers = main + (
            self.draft.page_buffers() if self.draft is not None else [])
        self.disagg = DisaggExecutor(create_manager(
            backend, role, buffers, host=host,
            bootstrap_port=bootstrap_port, num_metadata_slots=num_metadata_slots,
            page_size=self.plan.page_size, kv_dtype=self.plan.dtype, tp_rank=tp[0],
            tp_size=tp[1], kv_replicated=self.plan.pool_kind == "mla",
            # hybrid SWA memory: the windowed layers' pool crosses as a second page region;
            # recurrent state: the state pool as a third (a request's final state slot)
            swa_buffers=page_buffers_of(self.swa_pool) if self.swa_pool is not None else (),
            state_buffers=self.state_pool.page_buffers() if self.state_pool is not None
            else ()))

    def enable_storage(self, backend: str, model: str, extra: dict, tp_rank: int = 0,
                       tp_size: int = 1) -> None:
        """HiCache L3 behind the host pool (after allocate_kv); see HiCacheExecutor."""
        if self.hicache is None:
            raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
        self.hicache.enable_storage(backend, model, extra, tp_rank, tp_size)

    def transfer_stats(self) -> dict:
        """Bytes, seconds and GB/s per direction of HiCache copies ({} without HiCache)."""
        return self.hicache.stats() if self.hicache else {}

    def shutdown(self) -> None:
        for name in reversed(EXECUTORS):  # PD first, the backups' host copies last
            executor = getattr(self, name)
            if executor is not None:
                executor.close()
                setattr(self, name, None)
