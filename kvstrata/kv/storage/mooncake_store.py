"""`--hicache-storage-backend mooncake`: flat KV pages in a Mooncake Store (distributed RAM
pool shared by many servers on many machines; `mooncake_master` keeps the object metadata,
each client contributes `global_segment_size` bytes of its memory to the pool).

One object per page, keyed `<namespace.name>/<page key>`, so servers of one namespace share
pages and others never see them. Pages move through two staging buffers registered with the
store once (one for puts, one for gets, so the backup and prefetch threads never share one):
`batch_put_from` / `batch_get_into` transfer straight from/to them; the host pool side is a
staging.py gather (one copy per page, no allocation) / one `set_flat_pages` per chunk of
`staging_pages` pages.

Extra config (SGLang's names; each falls back to SGLang's environment variable):
  master_server_address  MOONCAKE_MASTER              required, "host:port"
  metadata_server        MOONCAKE_TE_META_DATA_SERVER "P2PHANDSHAKE" (or an http:// URL)
  protocol               MOONCAKE_PROTOCOL            "tcp"
  device_name            MOONCAKE_DEVICE              "" (RDMA devices)
  local_hostname         LOCAL_HOSTNAME               "127.0.0.1" (set it on many machines)
  global_segment_size    MOONCAKE_GLOBAL_SEGMENT_SIZE 1 GiB contributed to the pool
  local_buffer_size      MOONCAKE_LOCAL_BUFFER_SIZE   16 MiB
  staging_pages          -                            pages per transfer chunk (<= 128)
Pages live as long as the clients that hold them: data in a server's segment goes when that
server exits (run a separate store client for persistence, as SGLang's docs advise).
"""
from __future__ import annotations

import logging
import os
import re
import socket
import threading
from typing import Any

import torch

from kvstrata.kv.storage.base import PREFETCH_CONFIG_KEYS, StorageBackend
from kvstrata.kv.storage.staging import FlatPageStaging

logger = logging.getLogger(__name__)

MiB, GiB = 1 << 20, 1 << 30
MAX_STAGING_PAGES = 128   # machine-facts: very large TCP batches need mooncake env knobs
STAGING_TARGET_BYTES = 64 * MiB
# key -> (environment fallback, type, default)
OPTIONS = {
    "master_server_address": ("MOONCAKE_MASTER", str, None),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER", str, "P2PHANDSHAKE"),
    "protocol": ("MOONCAKE_PROTOCOL", str, "tcp"),
    "device_name": ("MOONCAKE_DEVICE", str, ""),
    "local_hostname": ("LOCAL_HOSTNAME", str, "127.0.0.1"),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE", int, GiB),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE", int, 16 * MiB),
    "staging_pages": (None, int, None),
}


def parse_options(extra: dict[str, Any], environ=os.environ) -> dict[str, Any]:
    opts = {}
    for name, (env, kind, default) in OPTIONS.items():
        raw = extra.get(name)
        if raw is None and env is not None:
            raw = environ.get(env)
        if raw is None:
            raw = default
        if raw is not None:
            try:
                raw = kind(raw)
            except (TypeError, ValueError):
                raise ValueError(f"--hicache-storage-backend-extra-config {name}={raw!r} is "
                                 f"not a valid {kind.__name__}") from None
        opts[name] = raw
    if not opts["master_server_address"]:
        raise ValueError("the mooncake storage backend needs the master's address: "
                         "--hicache-storage-backend-extra-config "
                         "'{\"master_server_address\": \"host:port\"}' or MOONCAKE_MASTER")
    for name in ("global_segment_size", "local_buffer_size", "staging_pages"):
        if opts[name] is not None and opts[name] < (0 if name == "global_segment_size" else 1):
            raise ValueError(f"--hicache-storage-backend-extra-config {name} must be "
                             f"positive, got {opts[name]}")
    unknown = sorted(set(extra) - set(OPTIONS) - set(PREFETCH_CONFIG_KEYS) - {"key_salt"})
    if unknown:
        logger.warning("mooncake storage ignores unknown extra-config keys %s", unknown)
    return opts


def check_master_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail in seconds, naming the address, where the client would retry for ~90 s."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)),
                                 timeout=timeout).close()
    except (OSError, ValueError) as e:
        raise RuntimeError(f"mooncake master {address!r} (extra-config master_server_address "
                           f"or MOONCAKE_MASTER) is not reachable: {e}") from None


class MooncakeStorage(StorageBackend):
    def __init__(self, config, host_pool):
        super().__init__(config, host_pool)
        opts = parse_options(config.extra)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ImportError(
                "--hicache-storage-backend mooncake needs the mooncake-transfer-engine-non-cuda "
                f"wheel and Debian libibverbs1 (make setup): {e}") from e
        geom = host_pool.geom
        self.page_bytes = config.page_bytes
        self._dtype = geom.dtype
        self._prefix = config.namespace.name + "/"
        self.staging_pages = opts["staging_pages"] or max(1, min(
            MAX_STAGING_PAGES, STAGING_TARGET_BYTES // self.page_bytes))
        check_master_reachable(opts["master_server_address"])
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(opts["local_hostname"], opts["metadata_server"],
                               int(opts["global_segment_size"] * config.share),
                               opts["local_buffer_size"],
                               opts["protocol"], opts["device_name"],
                               opts["master_server_address"])
        if rc != 0:
            raise RuntimeError(f"Mooncake Store setup failed (rc={rc}) with master "
                               f"{opts['master_server_address']} and metadata server "
                               f"{opts['metadata_server']}")
        # (staging_pages, page_bytes) uint8 each; registered once, reused by every batch
        self._put_stage = FlatPageStaging(self.page_bytes, self.staging_pages)
        self._put_buf = self._register(self._put_stage.buffer)
        self._get_buf = self._register(
            torch.zeros((self.staging_pages, self.page_bytes), dtype=torch.uint8))
        self._put_lock, self._get_lock, self._stats_lock = (threading.Lock(),
                                                            threading.Lock(), threading.Lock())
        self._stats = dict.fromkeys(("pages_read", "pages_written", "bytes_read",
                                     "bytes_written", "pages_skipped", "read_misses",
                                     "write_failures"), 0)
        self._closed = False
        logger.info("mooncake storage: master %s, %d-page staging, namespace %s",
                    opts["master_server_address"], self.staging_pages, self._prefix[:-1])

    def _register(self, buf: torch.Tensor) -> torch.Tensor:
        rc = self._store.register_buffer(buf.data_ptr(), buf.numel())
        if rc != 0:
            raise RuntimeError(f"Mooncake Store register_buffer failed (rc={rc})")
        return buf

    def _keys(self, keys: list[str]) -> list[str]:
        return [self._prefix + k for k in keys]

    def _chunks(self, n: int):
        for start in range(0, n, self.staging_pages):
            yield start, min(n, start + self.staging_pages)

    def _exist_flags(self, store_keys: list[str]) -> list[bool]:
        return [r == 1 for r in self._store.batch_is_exist(store_keys)] if store_keys else []

    # ---- verbs ------------------------------------------------------------------------------

    def batch_exists(self, keys: list[str]) -> int:
        flags = self._exist_flags(self._keys(keys))
        return next((i for i, hit in enumerate(flags) if not hit), len(flags))

    def exist_flags(self, keys: list[str]) -> list[bool]:
        return self._exist_flags(self._keys(keys))

    def batch_get(self, keys: list[str], host_pages: list[int]) -> list[bool]:
        self._check_batch(keys, host_pages)
        store_keys = self._keys(keys)
        ok = [False] * len(keys)
        with self._get_lock:
            for start, end in self._chunks(len(keys)):
                rows = self._get_buf[:end - start]
                results = self._store.batch_get_into(
                    store_keys[start:end], [r.data_ptr() for r in rows],
                    [self.page_bytes] * (end - start))
                hits = [j for j, got in enumerate(results) if got == self.page_bytes]
                if hits:
                    flat = rows.view(self._dtype)
                    if len(hits) < len(rows):
                        flat = flat[hits]
                    self.host_pool.set_flat_pages([host_pages[start + j] for j in hits], flat)
                for j in hits:
                    ok[start + j] = True
        with self._stats_lock:
            got = sum(ok)
            self._stats["pages_read"] += got
            self._stats["bytes_read"] += got * self.page_bytes
            self._stats["read_misses"] += len(keys) - got
        return ok

    def batch_set(self, keys: list[str], host_pages: list[int]) -> list[bool]:
        self._check_batch(keys, host_pages)
        store_keys = self._keys(keys)
        exists = self._exist_flags(store_keys)
        todo, seen = [], set()
        for i, key in enumerate(store_keys):
            if not exists[i] and key not in seen:
                seen.add(key)
                todo.append(i)
        ok = [True] * len(keys)
        written = failed = 0
        with self._put_lock:
            for start, end in self._chunks(len(todo)):
                part = todo[start:end]
                rows = self._put_stage.gather(self.host_pool, [host_pages[i] for i in part])
                results = self._store.batch_put_from(
                    [store_keys[i] for i in part], [r.data_ptr() for r in rows],
                    [self.page_bytes] * len(part))
                bad = [i for i, rc in zip(part, results) if rc != 0]
                # a put that lost a race with another server's put of the same page is fine
                stored = self._exist_flags([store_keys[i] for i in bad])
                for i, there in zip(bad, stored):
                    if not there:
                        ok[i] = False
                written += len(part) - len(bad)
                failed += stored.count(False)
        if failed:
            bad_keys = {store_keys[i] for i in todo if not ok[i]}
            ok = [ok[i] and store_keys[i] not in bad_keys for i in range(len(keys))]
            logger.warning("mooncake storage: %d of %d pages failed to store", failed, len(todo))
        with self._stats_lock:
            self._stats["pages_skipped"] += len(keys) - len(todo)
            self._stats["pages_written"] += written
            self._stats["bytes_written"] += written * self.page_bytes
            self._stats["write_failures"] += failed
        return ok

    def clear(self) -> None:
        """Remove every page of this namespace from the store (all servers')."""
        self._store.remove_by_regex("^" + re.escape(self._prefix), True)

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            return dict(self._stats)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for buf in (self._put_buf, self._get_buf):
            self._store.unregister_buffer(buf.data_ptr())
        self._store.close()
