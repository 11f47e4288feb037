"""HiCache L3: storage backends that keep flat KV pages by chained page key (base.py)."""
from kvstrata.kv.storage.base import StorageBackend, StorageConfig, StorageNamespace
from kvstrata.kv.storage.registry import BACKENDS, create_storage_backend

__all__ = ["BACKENDS", "StorageBackend", "StorageConfig", "StorageNamespace",
           "create_storage_backend"]
