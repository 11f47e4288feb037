"""Storage backends by `--hicache-storage-backend` value. Backends with heavy dependencies
(mooncake) are imported only when chosen."""
from __future__ import annotations

import importlib

from kvstrata.kv.storage.base import StorageBackend, StorageConfig

# flag value -> "module:Class"
BACKENDS = {
    "memory": "kvstrata.kv.storage.memory:MemoryStorage",
    "file": "kvstrata.kv.storage.file_store:FileStorage",
    "mooncake": "kvstrata.kv.storage.mooncake_store:MooncakeStorage",
}


def create_storage_backend(name: str, config: StorageConfig, host_pool) -> StorageBackend:
    if name not in BACKENDS:
        raise ValueError(f"--hicache-storage-backend {name!r} is not available; choose one of "
                         f"{', '.join(sorted(BACKENDS))}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(config, host_pool)
