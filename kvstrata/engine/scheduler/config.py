"""What the scheduler is configured with: the KV plan it schedules into, plus the scheduling
policy (no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kvstrata.cache.storage_tier import PrefetchConfig
from kvstrata.config.kv_plan import KVPlan
from kvstrata.config.rules.recurrent import check_strategy, track_interval
from kvstrata.config.server_args import ServerArgs, parse_extra_config


_PD_FIELDS = ("disaggregation_mode", "num_reserved_decode_tokens",
              "disaggregation_decode_extra_slots", "disaggregation_decode_polling_interval",
              "disaggregation_decode_retraction_backup",
              "disaggregation_decode_enable_radix_cache")
RETRACTION_BACKENDS = ("cpu_tensor", "host_pool")
_STORAGE_FIELDS = ("hicache_storage_backend", "hicache_storage_prefetch_policy",
                   "hicache_storage_backend_extra_config")
_PRIORITY_FIELDS = ("enable_priority_scheduling", "disable_priority_preemption",
                    "default_priority_value", "abort_on_priority_when_disabled",
                    "schedule_low_priority_values_first",
                    "priority_scheduling_preemption_threshold", "max_queued_requests")
_STATE_FIELDS = ("mamba_radix_cache_strategy", "mamba_track_interval")
_SPEC_FIELDS = ("speculative_algorithm", "speculative_num_draft_tokens",
                "speculative_disable_by_batch_size",
                "speculative_ngram_min_match_window_size",
                "speculative_ngram_max_match_window_size", "speculative_ngram_branch_length",
                "speculative_ngram_capacity", "speculative_ngram_min_bfs_breadth",
                "speculative_ngram_max_bfs_breadth", "speculative_ngram_match_type",
                "speculative_eagle_topk", "speculative_num_steps")


def _arg(name: str) -> Any:
    """A field whose default is ServerArgs' (one home for each default)."""
    return field(default=_SERVER_DEFAULTS[name])


_SERVER_DEFAULTS = {f.name: f.default for f in fields(ServerArgs)}


@dataclass(init=False)
class SchedulerConfig:
    """The KV plan to schedule into, plus the scheduling policy. Policy field names are the
    ServerArgs names and their defaults are ServerArgs' (`_arg`), so `from_args` copies them
    without a hand-written mapping and no default is restated here."""
    plan: KVPlan
    max_prefill_tokens: int = _arg("max_prefill_tokens")
    chunked_prefill_size: int | None = _arg("chunked_prefill_size")  # None or <= 0: no chunking
    schedule_policy: str = _arg("schedule_policy")  # fcfs | lpm | lof
    schedule_conservativeness: float = _arg("schedule_conservativeness")
    disable_radix_cache: bool = _arg("disable_radix_cache")
    radix_eviction_policy: str = _arg("radix_eviction_policy")
    hicache_write_policy: str = _arg("hicache_write_policy")
    # HiCache L3 (cache/storage_tier.py): on when a backend is named. The extra config's
    # prefetch keys (PREFETCH_CONFIG_KEYS) tune the policy; the runner gets the rest.
    hicache_storage_backend: str | None = _arg("hicache_storage_backend")
    hicache_storage_prefetch_policy: str = _arg("hicache_storage_prefetch_policy")
    hicache_storage_backend_extra_config: str | None = _arg("hicache_storage_backend_extra_config")
    # Prefill/decode disaggregation (engine/sides/disagg_*.py). "null": co-located, unchanged.
    disaggregation_mode: str = _arg("disaggregation_mode")  # null | prefill | decode
    # Decode admission: KV tokens reserved per request already on the decode server.
    num_reserved_decode_tokens: int = _arg("num_reserved_decode_tokens")
    # Decode: requests that may hold KV (in transfer, or transferred and waiting for a batch
    # slot) beyond max_running_requests. None: SGLang's rule, see decode_extra_slots.
    disaggregation_decode_extra_slots: int | None = _arg("disaggregation_decode_extra_slots")
    # Decode: admit new transfers every this many scheduler steps.
    disaggregation_decode_polling_interval: int = _arg("disaggregation_decode_polling_interval")
    # Decode: where a retracted request's KV is kept (the resolved value; None: host_pool
    # when the plan has a retraction host pool, else cpu_tensor). engine/sides/disagg_retract.py.
    disaggregation_decode_retraction_backup: str | None = _arg(
        "disaggregation_decode_retraction_backup")
    # Decode: keep finished requests' KV in a radix tree; a new request's cached prefix is
    # not transferred again (engine/sides/disagg_decode.py).
    disaggregation_decode_enable_radix_cache: bool = _arg(
        "disaggregation_decode_enable_radix_cache")
    # Priority scheduling and the bounded waiting queue (engine/sides/priority.py), SGLang's flags.
    enable_priority_scheduling: bool = _arg("enable_priority_scheduling")
    disable_priority_preemption: bool = _arg("disable_priority_preemption")
    default_priority_value: int | None = _arg("default_priority_value")
    abort_on_priority_when_disabled: bool = _arg("abort_on_priority_when_disabled")
    schedule_low_priority_values_first: bool = _arg("schedule_low_priority_values_first")
    priority_scheduling_preemption_threshold: int = _arg("priority_scheduling_preemption_threshold")
    max_queued_requests: int | None = _arg("max_queued_requests")
    # Speculative decoding (engine/sides/speculative.py), the resolved values: None = off.
    speculative_algorithm: str | None = _arg("speculative_algorithm")  # NGRAM only (start-up)
    # ServerArgs leaves it to resolution; NGRAM's resolved default is the max match window
    # (rules/speculative.py spec.ngram_tokens).
    speculative_num_draft_tokens: int = _arg("speculative_ngram_max_match_window_size")
    # Above this many running requests no drafts; None: measured (engine/sides/spec_gate.py).
    speculative_disable_by_batch_size: int | None = _arg("speculative_disable_by_batch_size")
    speculative_ngram_min_match_window_size: int = _arg("speculative_ngram_min_match_window_size")
    speculative_ngram_max_match_window_size: int = _arg("speculative_ngram_max_match_window_size")
    speculative_ngram_branch_length: int = _arg("speculative_ngram_branch_length")
    speculative_ngram_capacity: int = _arg("speculative_ngram_capacity")
    # NGRAM trees: a breadth above 1 or PROB matching (None: resolution's chain default).
    speculative_ngram_min_bfs_breadth: int = _arg("speculative_ngram_min_bfs_breadth")
    speculative_ngram_max_bfs_breadth: int | None = _arg("speculative_ngram_max_bfs_breadth")
    speculative_ngram_match_type: str = _arg("speculative_ngram_match_type")
    # A draft model's tree (topk > 1): the runner expands topk per node for num_steps.
    speculative_eagle_topk: int | None = _arg("speculative_eagle_topk")
    speculative_num_steps: int | None = _arg("speculative_num_steps")
    # Recurrent state (plan.has_state_pool; cache/state_slots.py): the snapshot prefix
    # cache's strategy (auto = config/rules/recurrent.py's choice) and extra_buffer's track
    # cadence.
    mamba_radix_cache_strategy: str = _arg("mamba_radix_cache_strategy")
    mamba_track_interval: int | None = _arg("mamba_track_interval")

    def __init__(self, plan: KVPlan | None = None, *, num_pages: int | None = None,
                 page_size: int = 1, max_running_requests: int = 64, num_host_pages: int = 0,
                 host_pool_use: str | None = None, num_swa_pages: int = 0, swa_window: int = 0,
                 num_state_slots: int = 0, num_host_state_slots: int = 0,
                 pages_hold_kv: bool = True, **policy: Any):
        """The server passes the plan the engine factory sized. Torch-free tests may pass
        page counts instead: they build a bookkeeping-only plan (KVPlan.pages_only); there a
        decode server's host pages are its retraction host pool unless `host_pool_use`
        says "hicache"; `num_swa_pages` / `swa_window`: a hybrid SWA pool;
        `num_state_slots`: a recurrent state pool (bookkeeping only), `num_host_state_slots`
        its HiCache host state slots, `pages_hold_kv` False: a model whose layers are all
        recurrent (Mamba2: pages are addresses only, KVPlan.pages_hold_kv)."""
        if (plan is None) == (num_pages is None):
            raise TypeError("SchedulerConfig needs a KVPlan, or num_pages (a page-only plan)")
        # A decode server's host pages hold retraction backups, unless its radix cache has a
        # host tier (HiCache) and its backups are cpu_tensor.
        decode = policy.get("disaggregation_mode") == "decode"
        decode_hicache = decode and policy.get("disaggregation_decode_enable_radix_cache") \
            and policy.get("disaggregation_decode_retraction_backup") == "cpu_tensor"
        use = host_pool_use or ("retraction" if decode and not decode_hicache else "hicache")
        self.plan = plan or KVPlan.pages_only(
            num_pages=num_pages, page_size=page_size, num_rows=max_running_requests,
            num_host_pages=num_host_pages, host_pool_use=use, num_swa_pages=num_swa_pages,
            swa_window=swa_window, num_state_slots=num_state_slots,
            num_host_state_slots=num_host_state_slots, pages_hold_kv=pages_hold_kv)
        for f in fields(self):
            if f.name != "plan":
                setattr(self, f.name, policy.pop(f.name, f.default))
        if policy:
            raise TypeError(f"unknown SchedulerConfig field(s): {', '.join(sorted(policy))}")
        if self.speculative_algorithm not in (None, "NGRAM", "STANDALONE", "EAGLE", "EAGLE3"):
            raise ValueError(f"not implemented yet: --speculative-algorithm "
                             f"{self.speculative_algorithm}")
        if self.disaggregation_mode not in ("null", "prefill", "decode"):
            raise ValueError("--disaggregation-mode must be null, prefill or decode, got "
                             f"{self.disaggregation_mode!r}")
        self._check_host_pool()
        self._check_state_pool()

    def _check_state_pool(self) -> None:
        """What a recurrent state pool is not built beside yet (config/rules/recurrent.py
        refuses the flags at start-up; this guards configs built without resolution)."""
        if not self.plan.has_state_pool:
            return
        # EAGLE here is NEXTN resolved: Qwen3-Next's or Qwen3.5's MTP layer (resolution
        # refuses EAGLE heads and other hybrids' NEXTN by name); its chains verify like the
        # others
        chain_eagle = self.speculative_algorithm == "EAGLE" and self.speculative_eagle_topk == 1
        if self.speculative_algorithm not in (None, "NGRAM", "STANDALONE") and not chain_eagle:
            raise ValueError(f"a recurrent state pool does not support "
                             f"--speculative-algorithm {self.speculative_algorithm} yet "
                             f"(NGRAM and STANDALONE chains, NEXTN chains on Qwen3-Next and Qwen3.5)")
        if self.disaggregation_mode == "decode" and self.disaggregation_decode_enable_radix_cache:
            raise ValueError("--disaggregation-decode-enable-radix-cache is incompatible with "
                             "Mamba/SSM models (a recurrent state pool)")
        if self.radix_cache:  # a strategy it cannot run (no_buffer with pages > 1) fails here
            check_strategy(self.mamba_radix_cache_strategy, self.page_size,
                           self.mamba_track_interval)

    @property
    def state_track_interval(self) -> int | None:
        """extra_buffer's track cadence, None otherwise (no_buffer, no radix cache, no state
        pool)."""
        if not self.plan.has_state_pool or not self.radix_cache:
            return None
        strategy = check_strategy(self.mamba_radix_cache_strategy, self.page_size,
                                  self.mamba_track_interval)
        return track_interval(self.mamba_track_interval, self.page_size) \
            if strategy == "extra_buffer" else None

    @property
    def radix_cache(self) -> bool:
        """A decode server matches prefixes only with its radix cache on (else chunk-cache
        semantics, SGLang's default)."""
        return not self.disable_radix_cache and (
            self.disaggregation_mode != "decode" or self.disaggregation_decode_enable_radix_cache)

    @property
    def backups_share_host(self) -> bool:
        """A decode server with HiCache and host_pool retraction backups: one host pool,
        sized by the HiCache flags, holds the tree's host pages and the backups."""
        return (self.disaggregation_mode == "decode" and self.plan.has_host_pool
                and self.plan.host_pool_use == "hicache" and self.retraction_backup == "host_pool")

    def _check_host_pool(self) -> None:
        """A decode server's host pool is its retraction host pool, or with the decode radix
        cache HiCache's host tier behind that tree (retraction backups are then cpu_tensor,
        or host_pool in the same pool: backups_share_host); only a decode server has a
        retraction pool."""
        plan, decode = self.plan, self.disaggregation_mode == "decode"
        retraction_pool = plan.has_host_pool and plan.host_pool_use == "retraction"
        if plan.has_host_pool and plan.has_swa_pool and plan.full_pool_plan() is None:
            # (HiCache's host tier and host_pool backups keep an SWA pool's pages beside the
            # full pages they belong to: cache/swa_hiradix.py, retraction_backup.py)
            raise ValueError("a host KV pool holds full-attention pages, which an all-SWA model "
                             "does not have: use --disaggregation-decode-retraction-backup "
                             "cpu_tensor and no HiCache")
        if decode and plan.has_host_pool and not retraction_pool and not self.radix_cache:
            raise ValueError("--disaggregation-mode decode runs without a radix cache, so it "
                             "cannot use --enable-hierarchical-cache (add "
                             "--disaggregation-decode-enable-radix-cache)")
        if retraction_pool and not decode:
            raise ValueError("a retraction host pool is for --disaggregation-mode decode only")
        backup = self.disaggregation_decode_retraction_backup
        if backup is not None and backup not in RETRACTION_BACKENDS:
            raise ValueError(f"--disaggregation-decode-retraction-backup must be one of "
                             f"{', '.join(RETRACTION_BACKENDS)}, got {backup!r}")
        host_pool_backup = decode and self.retraction_backup == "host_pool"
        if (host_pool_backup and not plan.has_host_pool) or (retraction_pool
                                                             and not host_pool_backup):
            raise ValueError(f"--disaggregation-decode-retraction-backup "
                             f"{self.retraction_backup} needs "
                             f"{'a' if retraction_pool is False else 'no'} retraction host pool "
                             f"in the KV plan (num_host_pages {plan.num_host_pages})")

    def prefetch_config(self) -> PrefetchConfig | None:
        """The L3 prefetch policy, or None without a storage backend. A decode server's store
        is its KV offload (backups of its tree's host pages); it never prefetches
        (Scheduler.add)."""
        if self.hicache_storage_backend is None:
            return None
        return PrefetchConfig.from_extra(
            self.hicache_storage_prefetch_policy,
            parse_extra_config(self.hicache_storage_backend_extra_config))

    @classmethod
    def from_args(cls, args: Any, plan: KVPlan) -> "SchedulerConfig":
        # PD and storage fields default when the args lack them (an args-like namespace
        # from before those flags); the others must exist.
        optional = _PD_FIELDS + _STORAGE_FIELDS + _SPEC_FIELDS + _PRIORITY_FIELDS + _STATE_FIELDS
        values = {f.name: (getattr(args, f.name, f.default) if f.name in optional
                           else getattr(args, f.name))
                  for f in fields(cls) if f.name != "plan"}
        if values["speculative_num_draft_tokens"] is None:  # unresolved args: the default
            values.pop("speculative_num_draft_tokens")
        return cls(plan, **values)

    @property
    def priority_preemption(self) -> bool:
        return self.enable_priority_scheduling and not self.disable_priority_preemption

    @property
    def priority_sign(self) -> int:
        """+1 when low priority values go first, else -1: `priority * sign` sorts ascending
        from the most preferred request."""
        return 1 if self.schedule_low_priority_values_first else -1

    @property
    def decode_extra_slots(self) -> int:
        """SGLang's default (None): 2 x max_running_requests when that is <= 32, else 0."""
        extra = self.disaggregation_decode_extra_slots
        if extra is None:
            mrr = self.max_running_requests
            return 2 * mrr if mrr <= 32 else 0
        return extra

    @property
    def retraction_backup(self) -> str:
        """The decode retraction backend: the resolved flag, else what the plan holds."""
        backup = self.disaggregation_decode_retraction_backup
        if backup is None:
            plan = self.plan
            return ("host_pool" if plan.has_host_pool and plan.host_pool_use == "retraction"
                    else "cpu_tensor")
        return backup

    # Read from the plan (one source), under the names the scheduler has always used.
    @property
    def page_size(self) -> int:
        return self.plan.page_size

    @property
    def num_pages(self) -> int:
        return self.plan.num_pages

    @property
    def max_running_requests(self) -> int:
        return self.plan.num_rows

    @property
    def num_host_pages(self) -> int:
        return self.plan.num_host_pages
