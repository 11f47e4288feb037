"""Prometheus collectors of the api server.

A private CollectorRegistry per server (not the process-global one), so that tests can build
several apps in one process without "duplicated timeseries" errors. Names use the
`kvstrata:` prefix the way SGLang uses `sglang:`, so dashboards port by renaming.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

ABORT_REASONS = ("client_disconnect", "abort_request", "engine_dead")
RETRACTION_BACKENDS = ("cpu_tensor", "host_pool")
# HiCache L3 totals (load-report key hicache_storage_<name>) exported as counters.
STORAGE_COUNTERS = {
    "hit_tokens": "Prompt tokens prefetched from storage into the host tier",
    "miss_tokens": "Prompt tokens asked of storage and not found",
    "bytes_read": "Bytes read from storage", "bytes_written": "Bytes written to storage",
    "backup_pages": "Pages backed up to storage (stored or found already stored)",
    "backup_failed_pages": "Pages a backup failed to store",
    "errors": "Storage jobs ended by a backend error",
    # A recurrent model's state snapshots (cache/state_storage.py; 0 for other models).
    "state_backups": "State snapshots stored beside their pages (or found already stored)",
    "state_hits": "State snapshots read back from storage and resumed from",
    # The backend's own counts (file and mooncake report them; 0 where a backend has none).
    "read_misses": "Pages asked of the storage backend and not found",
    "corrupt_records": "Stored records that failed their checksum (read as misses)",
    "write_failures": "Pages the storage backend failed to write",
}
PREFETCH_OUTCOMES = ("complete", "partial", "cancelled", "revoked")
# PD decode + NEXTN with IndexShare: what fed each first draft round's sparse attention
# (load keys spec_dsa_seed_<outcome>; counter kvstrata:spec_dsa_seed_total{outcome}).
DSA_SEED_OUTCOMES = ("used", "recomputed", "failed_closed")



class ServerMetrics:
    def __init__(self, model_name: str, side_counters: dict[str, str] | None = None):
        """`side_counters`: load-report keys of the scheduler's sides that are running totals
        -> help (each side class's `counters`, engine/sides/registry.py side_counters()),
        exported as counters kvstrata:<key>."""
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._prompt_tokens = Counter("kvstrata:prompt_tokens", "Prompt tokens processed",
                                      labels, registry=r)
        self._generation_tokens = Counter("kvstrata:generation_tokens", "Tokens generated",
                                          labels, registry=r)
        self._cached_tokens = Counter("kvstrata:cached_tokens", "Prompt tokens served from "
                                      "the prefix cache", labels, registry=r)
        self._requests = Counter("kvstrata:num_requests", "Finished requests",
                                 labels + ["finish_reason"], registry=r)
        # Requests that ended early, by who ended them: client_disconnect (the client went
        # away before the end), abort_request (the /abort_request route), engine_dead (failed
        # because the scheduler or detokenizer process exited).
        self._aborted = Counter("kvstrata:num_aborted_requests", "Requests aborted before "
                                "they finished, by reason", labels + ["reason"], registry=r)
        self._ttft = Histogram("kvstrata:time_to_first_token_seconds", "Time to first token",
                               labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._tpot = Histogram("kvstrata:time_per_output_token_seconds",
                               "Mean time per output token after the first, per request",
                               labels, buckets=_TPOT_BUCKETS, registry=r)
        self._e2e = Histogram("kvstrata:e2e_request_latency_seconds", "End-to-end latency",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._running = Gauge("kvstrata:num_running_reqs", "Requests running", labels,
                              registry=r)
        self._queued = Gauge("kvstrata:num_queue_reqs", "Requests waiting", labels, registry=r)
        self._used_tokens = Gauge("kvstrata:num_used_tokens", "KV slots in use", labels,
                                  registry=r)
        self._token_usage = Gauge("kvstrata:token_usage", "KV pool usage (0..1)", labels,
                                  registry=r)
        # Hybrid SWA memory only: the sliding-window layers' pool (/get_load's *_swa_*).
        self._used_swa_tokens = Gauge("kvstrata:num_used_swa_tokens",
                                      "Sliding-window KV slots in use", labels, registry=r)
        self._swa_token_usage = Gauge("kvstrata:swa_token_usage",
                                      "Sliding-window KV pool usage (0..1)", labels, registry=r)
        # Recurrent state only: the state pool's slots (/get_load's *_state_*).
        self._used_state_slots = Gauge("kvstrata:num_used_state_slots", "Recurrent state "
                                       "slots held by requests", labels, registry=r)
        self._state_slot_usage = Gauge("kvstrata:state_slot_usage", "Recurrent state pool "
                                       "usage (0..1)", labels, registry=r)
        self._hit_rate = Gauge("kvstrata:cache_hit_rate", "Prefix-cache hit rate (0..1)",
                               labels, registry=r)
        # HiCache L2 (only with --enable-hierarchical-cache): hit tokens per tier, pages and
        # bytes moved per direction, copy GB/s, host pool usage; one gauge, one label per stat.
        self._hicache = Gauge("kvstrata:hicache", "HiCache L2 statistics (see the stat label)",
                              labels + ["stat"], registry=r)
        # Decode retraction with KV backup (PD decode servers; engine/sides/disagg_retract.py). The
        # load report carries running totals; the counters advance by the difference.
        self._decode_retracted = Gauge("kvstrata:num_decode_retracted_reqs", "Retracted "
                                       "requests waiting to be restored (decode server)",
                                       labels, registry=r)
        self._decode_retractions = Counter("kvstrata:decode_retractions", "Decode requests "
                                           "retracted with a KV backup", labels, registry=r)
        self._decode_backups = Counter("kvstrata:decode_retraction_backups", "Retraction KV "
                                       "backups, by backend", labels + ["backend"], registry=r)
        self._decode_restores = Counter("kvstrata:decode_retraction_restores", "Retraction "
                                        "KV restores, by backend", labels + ["backend"],
                                        registry=r)
        self._decode_backup_bytes = Counter("kvstrata:decode_retraction_backup_bytes",
                                            "Bytes of KV backed up by decode retraction",
                                            labels, registry=r)
        self._decode_exhausted = Counter("kvstrata:decode_retraction_exhausted_aborts",
                                         "Requests aborted because the retraction host KV "
                                         "pool was exhausted", labels, registry=r)
        # HiCache L3 (with --hicache-storage-backend): running totals from the load report.
        self._storage = {
            key: Counter(f"kvstrata:hicache_storage_{key}", doc, labels, registry=r)
            for key, doc in STORAGE_COUNTERS.items()}
        self._prefetch = Counter("kvstrata:hicache_storage_prefetch", "Storage prefetches by "
                                 "outcome", labels + ["outcome"], registry=r)
        # Speculative decoding (from the load report): SGLang's accept length, and the
        # counts it is made of.
        self._spec_accept_length = Gauge("kvstrata:spec_accept_length", "Average tokens per "
                                         "verify pass (accepted drafts + 1)", labels,
                                         registry=r)
        self._dsa_seed = Counter("kvstrata:spec_dsa_seed", "First draft rounds of PD "
                                 "requests (NEXTN + IndexShare) by what fed their sparse "
                                 "attention: the prefill's top-k seed, or the indexer",
                                 labels + ["outcome"], registry=r)
        self._side = {key: Counter(f"kvstrata:{key}", doc, labels, registry=r)
                      for key, doc in (side_counters or {}).items()}
        self._seen: dict[str, float] = {}
        self.model_name = model_name
        for reason in ABORT_REASONS:  # export zeros, so dashboards see the series at once
            self._aborted.labels(model_name, reason)

    def on_finish(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                  finish_type: str, ttft: float | None, e2e: float) -> None:
        m = self.model_name
        self._prompt_tokens.labels(m).inc(prompt_tokens)
        self._generation_tokens.labels(m).inc(completion_tokens)
        self._cached_tokens.labels(m).inc(cached_tokens)
        self._requests.labels(m, finish_type or "unknown").inc()
        self._e2e.labels(m).observe(e2e)
        if ttft is not None:
            self._ttft.labels(m).observe(ttft)
            if completion_tokens > 1:
                self._tpot.labels(m).observe((e2e - ttft) / (completion_tokens - 1))

    def on_abort(self, reason: str, count: int = 1) -> None:
        self._aborted.labels(self.model_name, reason).inc(count)

    def set_load(self, load: dict) -> None:
        m = self.model_name
        self._running.labels(m).set(load.get("num_running_reqs", 0))
        self._queued.labels(m).set(load.get("num_waiting_reqs", 0))
        self._used_tokens.labels(m).set(load.get("num_used_tokens", 0))
        self._token_usage.labels(m).set(load.get("token_usage", 0.0))
        self._hit_rate.labels(m).set(load.get("cache_hit_rate", 0.0))
        if "swa_token_usage" in load:
            self._used_swa_tokens.labels(m).set(load["num_used_swa_tokens"])
            self._swa_token_usage.labels(m).set(load["swa_token_usage"])
        if "state_slot_usage" in load:
            self._used_state_slots.labels(m).set(load["num_used_state_slots"])
            self._state_slot_usage.labels(m).set(load["state_slot_usage"])
        for key, value in load.items():
            if key.startswith("hicache_") and isinstance(value, (int, float)):
                self._hicache.labels(m, key.removeprefix("hicache_")).set(value)
        if "decode_retractions_total" in load:
            self._set_decode_retraction(load)
        if "hicache_storage_hit_tokens" in load:
            self._set_storage(load)
        if "avg_spec_accept_length" in load:
            self._spec_accept_length.labels(m).set(load["avg_spec_accept_length"])
            for outcome in DSA_SEED_OUTCOMES:
                self._advance(f"spec_dsa_seed_{outcome}",
                              load.get(f"spec_dsa_seed_{outcome}", 0),
                              self._dsa_seed.labels(m, outcome))
        for key, counter in self._side.items():
            if key in load:
                self._advance(key, load[key], counter.labels(m))

    def _advance(self, key: str, value: float, counter) -> None:
        """Counters follow a running total: advance by what it grew since the last report."""
        delta = value - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = value

    def _set_storage(self, load: dict) -> None:
        m = self.model_name
        for key, counter in self._storage.items():
            self._advance(f"storage_{key}", load.get(f"hicache_storage_{key}", 0),
                          counter.labels(m))
        for outcome in PREFETCH_OUTCOMES:
            self._advance(f"prefetch_{outcome}", load.get(f"hicache_storage_prefetch_{outcome}", 0),
                          self._prefetch.labels(m, outcome))

    def _set_decode_retraction(self, load: dict) -> None:
        m = self.model_name
        self._decode_retracted.labels(m).set(load.get("num_decode_retracted", 0))
        totals = [("decode_retractions_total", self._decode_retractions.labels(m)),
                  ("decode_backup_bytes", self._decode_backup_bytes.labels(m)),
                  ("decode_backup_exhausted_aborts", self._decode_exhausted.labels(m))]
        for backend in RETRACTION_BACKENDS:
            totals += [(f"decode_backups_{backend}", self._decode_backups.labels(m, backend)),
                       (f"decode_restores_{backend}", self._decode_restores.labels(m, backend))]
        for key, counter in totals:
            self._advance(key, load.get(key, 0), counter)

    def render(self) -> bytes:
        return generate_latest(self.registry)
