"""In-process storage backend (`--hicache-storage-backend memory`): a dict of flat pages.

For tests and for trying the L3 machinery without a disk; it dies with the process. Pages
are copied in and out (a stored page never aliases host memory that may be reused).

Each instance has its own pages, unless the extra config names a `memory_store_id`: instances
of one process with the same id share one store (two engines in one test process, or a
writer and a reader pool of different layouts, see the same pages)."""
from __future__ import annotations

import threading
from typing import Any

import torch

from kvstrata.kv.storage.base import StorageBackend

# memory_store_id -> (pages, lock) shared by the instances that name it
_SHARED_STORES: dict[str, tuple[dict, threading.Lock]] = {}
_SHARED_LOCK = threading.Lock()


class MemoryStorage(StorageBackend):
    shared_across_processes = False  # memory_store_id shares within one process only

    def __init__(self, config, host_pool):
        super().__init__(config, host_pool)
        store_id = config.extra.get("memory_store_id")
        if store_id is None:
            self._pages: dict[str, torch.Tensor] = {}
            self._lock = threading.Lock()
        else:
            with _SHARED_LOCK:
                self._pages, self._lock = _SHARED_STORES.setdefault(
                    str(store_id), ({}, threading.Lock()))
        self._stats = {"pages_read": 0, "pages_written": 0, "bytes_read": 0,
                       "bytes_written": 0, "pages_skipped": 0}

    def _k(self, key: str) -> str:
        return f"{self.config.namespace.name}/{key}"

    def batch_exists(self, keys: list[str]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if self._k(key) not in self._pages:
                    return i
        return len(keys)

    def batch_get(self, keys: list[str], host_pages: list[int]) -> list[bool]:
        self._check_batch(keys, host_pages)
        with self._lock:
            found = [self._pages.get(self._k(k)) for k in keys]
        hits = [i for i, page in enumerate(found) if page is not None]
        if hits:
            self.host_pool.set_flat_pages([host_pages[i] for i in hits],
                                          torch.stack([found[i] for i in hits]))
            self._stats["pages_read"] += len(hits)
            self._stats["bytes_read"] += len(hits) * self.config.page_bytes
        return [page is not None for page in found]

    def batch_set(self, keys: list[str], host_pages: list[int]) -> list[bool]:
        self._check_batch(keys, host_pages)
        with self._lock:
            todo, seen = [], set()
            for i, k in enumerate(keys):  # a key twice in one batch is stored once
                if self._k(k) not in self._pages and k not in seen:
                    seen.add(k)
                    todo.append(i)
        self._stats["pages_skipped"] += len(keys) - len(todo)
        if todo:
            flat = self.host_pool.get_flat_pages([host_pages[i] for i in todo])
            with self._lock:
                for row, i in enumerate(todo):
                    self._pages[self._k(keys[i])] = flat[row].clone()
            self._stats["pages_written"] += len(todo)
            self._stats["bytes_written"] += len(todo) * self.config.page_bytes
        return [True] * len(keys)

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self._stats, "pages_stored": len(self._pages)}
