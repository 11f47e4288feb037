"""Extra-config options of the `file` storage backend (file_store.py) and their defaults.

  file_path           root directory (else KVSTRATA_HICACHE_FILE_DIR, else
                      $XDG_CACHE_HOME/kvstrata/hicache or ~/.cache/kvstrata/hicache);
                      each namespace gets a folder under it
  segment_bytes       size at which a writer starts a new segment (128 MiB)
  max_bytes           size cap of the namespace's segments; default 10 GiB, or half of the
                      free disk space at start (plus what is stored) when that is less, but
                      at least two segments
  index_flush_every   new records between index saves (1024; also saved on close)
  refresh_interval_s  least seconds between rescans for other processes' records (1.0)
  fsync               fdatasync a segment when it is closed (false: a crash can lose the
                      unsynced tail, which the next start ignores as a torn tail)
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from kvstrata import envs
from kvstrata.kv.storage.base import PREFETCH_CONFIG_KEYS

logger = logging.getLogger(__name__)

MiB, GiB = 1 << 20, 1 << 30
DEFAULT_SEGMENT_BYTES = 128 * MiB
DEFAULT_MAX_BYTES = 10 * GiB

# extra-config keys of this backend, with their types and defaults (None = computed)
OPTIONS = {"file_path": (str, None), "segment_bytes": (int, DEFAULT_SEGMENT_BYTES),
           "max_bytes": (int, None), "index_flush_every": (int, 1024),
           "refresh_interval_s": (float, 1.0), "fsync": (bool, False)}
SHARED_KEYS = set(PREFETCH_CONFIG_KEYS) | {"key_salt"}  # read by other layers


def default_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return envs.KVSTRATA_HICACHE_FILE_DIR.get() or os.path.join(base, "kvstrata", "hicache")


def parse_options(extra: dict[str, Any]) -> dict[str, Any]:
    opts = {}
    for name, (kind, default) in OPTIONS.items():
        raw = extra.get(name, default)
        if raw is not None and not isinstance(raw, kind):
            try:
                raw = kind(raw) if kind is not bool else str(raw).lower() in ("1", "true")
            except (TypeError, ValueError):
                raise ValueError(f"--hicache-storage-backend-extra-config {name}={raw!r} is "
                                 f"not a valid {kind.__name__}") from None
        opts[name] = raw
    for name in ("segment_bytes", "max_bytes", "index_flush_every"):
        if opts[name] is not None and opts[name] < 1:
            raise ValueError(f"--hicache-storage-backend-extra-config {name} must be >= 1, "
                             f"got {opts[name]}")
    unknown = sorted(set(extra) - set(OPTIONS) - SHARED_KEYS)
    if unknown:
        logger.warning("file storage ignores unknown extra-config keys %s (it reads %s)",
                       unknown, ", ".join(OPTIONS))
    return opts


def resolve_max_bytes(requested: int | None, directory: str, stored_bytes: int,
                      segment_bytes: int, share: float = 1.0) -> int:
    """The cap, times `share` (StorageConfig.share: one of two backends of a root)."""
    if requested is None:
        free = shutil.disk_usage(directory).free
        requested = int(min(DEFAULT_MAX_BYTES, (free + stored_bytes) // 2) * share)
        requested = max(requested, 2 * segment_bytes)
    else:
        requested = int(requested * share)
    if requested < segment_bytes:
        raise ValueError(f"--hicache-storage-backend-extra-config max_bytes ({requested}) "
                         f"must be at least segment_bytes ({segment_bytes}): "
                         "eviction deletes whole segments")
    return requested
