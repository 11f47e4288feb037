"""The HiCache L3 tier's configuration and records (no torch): the prefetch policy and its
timeouts (SGLang's names and defaults), the counters /server_info reports, and the state of
one prefetch or one backup job (cache/storage_tier.py decides with them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstrata.cache.radix_cache import TreeNode

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# SGLang's current defaults (PrefetchTimeoutConfig; prefetch_threshold 256 tokens).
PREFETCH_DEFAULTS = {"prefetch_threshold": 256, "prefetch_timeout_base": 2.0,
                     "prefetch_timeout_per_ki_token": 0.1, "prefetch_timeout_max": 30.0}
# Prefetches may hold at most this share of (host - device) pages at once (SGLang's limit).
PREFETCH_CAPACITY_SHARE = 0.8


@dataclass(frozen=True)
class PrefetchConfig:
    policy: str = "timeout"
    threshold_tokens: int = 256
    timeout_base: float = 2.0
    timeout_per_ki_token: float = 0.1
    timeout_max: float = 30.0

    @classmethod
    def from_extra(cls, policy: str, extra: dict[str, Any]) -> "PrefetchConfig":
        """From --hicache-storage-prefetch-policy and the extra config's prefetch keys."""
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"--hicache-storage-prefetch-policy must be one of "
                             f"{', '.join(PREFETCH_POLICIES)}, got {policy!r}")
        values = {}
        for key, default in PREFETCH_DEFAULTS.items():
            v = extra.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"--hicache-storage-backend-extra-config {key} must be a "
                                 f"number >= 0, got {v!r}")
            values[key] = v
        return cls(policy, int(values["prefetch_threshold"]), float(values["prefetch_timeout_base"]),
                   float(values["prefetch_timeout_per_ki_token"]),
                   float(values["prefetch_timeout_max"]))

    def timeout_seconds(self, tokens: int) -> float:
        return min(self.timeout_base + self.timeout_per_ki_token * tokens / 1024,
                   self.timeout_max)


@dataclass
class StorageStats:
    hit_tokens: int = 0          # prefetched into the host tier (then loaded like host hits)
    miss_tokens: int = 0         # asked of storage and not found
    backup_pages: int = 0        # pages a backup stored (or found already stored)
    backup_failed_pages: int = 0
    errors: int = 0              # jobs that ended with a backend error
    prefetch_complete: int = 0
    prefetch_partial: int = 0    # stopped (policy, corruption) before every hit page was read
    prefetch_cancelled: int = 0  # the request was aborted
    prefetch_revoked: int = 0    # fewer hit tokens than the threshold: nothing kept
    swa_healed_pages: int = 0    # hybrid SWA: tree pages a fetch's lead gave their SWA half
    swa_lead_unused_pages: int = 0  # ... and lead pages read for nothing (not hits)
    state_backups: int = 0       # recurrent state: snapshots stored (or found stored)
    state_backup_failed: int = 0  # ... not stored (a backend failure)
    state_hits: int = 0          # ... read back and filed as a node's host snapshot


@dataclass
class Prefetch:
    job_id: int
    rid: str
    token_ids: list[int]          # the request's matchable prefix, up to the last fetched page
    start_page: int               # first fetched page (the device+host match at arrival,
                                  # less lead_pages)
    host_pages: list[int]
    started_at: float
    hit_pages: int = -1
    done_pages: int = 0
    finished: bool = False
    cancel_sent: bool = False
    aborted: bool = False
    revoked: bool = False
    # hybrid SWA memory (cache/swa_storage.py): pages (index from start_page) whose SWA half
    # was read too
    swa_read: set[int] = field(default_factory=set)
    # ... and how many fetched pages the tree held already (fetched to heal the window that
    # straddles the tree's end: SWAStorageTier._lead_pages)
    lead_pages: int = 0
    # recurrent state (cache/state_storage.py): the host state slot the job reads the
    # snapshot into (0 once the tree adopted it), and the page end it is at (0: none read)
    host_state: int = 0
    state_page: int = 0


@dataclass
class Backup:
    nodes: list[TreeNode] = field(default_factory=list)  # pinned with host_ref
