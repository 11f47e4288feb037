"""The HiCache L3 storage interface: batched, page-addressed verbs between storage and the
host pool (kv/host_pool.py).

A backend stores *flat pages*: the bytes of one host page in a layout-independent order
(`HostKVPool.get_flat_pages`: every component, every layer, the page's tokens), so a server
whose host pool is page_first reads what a layer_first server wrote. Keys come from
cache/page_keys.py (chained SHA-256 per full page); the namespace below separates what must
never be mixed (another model, dtype, geometry, tp shard, tenant salt) and is applied by the
backend as a directory or a key suffix.

Verbs (all batched; a page is addressed by its key and a host page id):
  batch_exists(keys) -> int            consecutive hits from the first key
  exist_flags(keys) -> [bool]          each key's presence (sparse records: an SWA pool's)
  batch_get(keys, host_pages) -> [bool]  read pages into host pages; False = miss/corrupt
                                       (that host page's bytes are then unspecified)
  batch_set(keys, host_pages) -> [bool]  store host pages; a key already stored is skipped
                                       and reported True
  clear(), stats() -> dict, close()
A backend never returns wrong data for a key: a record that fails its checks is a miss.
Backends are thread-safe for one writer thread and one reader thread at a time (the storage
job runner uses one thread for backups and one for prefetches).
"""
from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from kvstrata.config.kv_plan import KVPlan

# extra-config keys the cache layer reads (prefetch policy); the rest go to the backend.
PREFETCH_CONFIG_KEYS = ("prefetch_threshold", "prefetch_timeout_base",
                        "prefetch_timeout_per_ki_token", "prefetch_timeout_max")


@dataclass(frozen=True)
class StorageNamespace:
    """What two servers must agree on to share stored pages."""
    model: str           # model identity: served model name, else the model path's name
    dtype: str           # KV dtype (torch name)
    geometry: str        # the plan's components and page size, e.g. "p16:k30x3x64,v30x3x64"
    tp_rank: int = 0
    tp_size: int = 1
    is_mla: bool = False  # MLA KV is identical on every tp rank: no rank in the namespace
    salt: str = ""        # tenant isolation (extra config `key_salt`)
    # hybrid SWA memory: which pool's records ("full" / "swa", cache/page_keys.py
    # COMPONENTS), or a recurrent model's state snapshots ("state"); "" for a uniform
    # pool, whose names stay what they were
    component: str = ""

    @classmethod
    def from_plan(cls, plan: KVPlan, model: str, *, tp_rank: int = 0, tp_size: int = 1,
                  salt: str = "", component: str = "") -> "StorageNamespace":
        """`plan`: the pool whose pages are stored (with hybrid SWA memory, the full or the
        SWA pool's plan, named by `component`)."""
        geometry = f"p{plan.page_size}:" + ",".join(
            f"{c.name}{c.num_layers}x{'x'.join(map(str, c.token_shape))}"
            for c in plan.components)
        return cls(model, plan.dtype or "none", geometry, tp_rank, tp_size,
                   plan.pool_kind == "mla", salt, component)

    @classmethod
    def for_states(cls, plan: KVPlan, model: str, *, tp_rank: int = 0, tp_size: int = 1,
                   salt: str = "") -> "StorageNamespace":
        """The namespace of a recurrent model's state snapshots (component "state",
        cache/state_storage.py): its geometry is the state components' (layers, slot shape,
        dtype each; a state is kept per request, not per page)."""
        geometry = "state:" + ",".join(
            f"{c.name}{c.num_layers}x{'x'.join(map(str, c.slot_shape))}:{c.dtype}"
            for c in plan.state_components)
        return cls(model, plan.dtype or "none", geometry, tp_rank, tp_size, False, salt,
                   "state")

    @property
    def name(self) -> str:
        """A file-system and key safe identifier: readable model part + a digest of it all."""
        ranks = "" if self.is_mla else f"|tp{self.tp_rank}/{self.tp_size}"
        full = f"{self.model}|{self.dtype}|{self.geometry}{ranks}|salt={self.salt}"
        if self.component:
            full += f"|component={self.component}"
        readable = re.sub(r"[^A-Za-z0-9._-]+", "-", self.model).strip("-")[:48] or "model"
        kind = f"-{self.component}" if self.component else ""
        return (f"{readable}-{self.dtype}{kind}-"
                f"{hashlib.sha256(full.encode()).hexdigest()[:16]}")


@dataclass
class StorageConfig:
    namespace: StorageNamespace
    page_bytes: int                      # bytes of one flat page
    extra: dict[str, Any] = field(default_factory=dict)  # backend keys of the extra config
    # Hybrid SWA memory and recurrent state open one backend per host pool kind
    # (runner/executors/hicache.py): each takes this share (by host pool bytes) of the extra
    # config's size limits (file max_bytes, mooncake global_segment_size), so together they
    # keep to what the flags say.
    share: float = 1.0


class StorageBackend(ABC):
    """See the module docstring. Subclasses register under the flag's value in registry.py."""
    # Every process that names the same namespace reads the same pages (files, Mooncake);
    # False for a store inside one process. Tensor parallelism on an MLA model: with a
    # shared store only rank 0 writes (every rank's latent KV is the same).
    shared_across_processes = True

    def __init__(self, config: StorageConfig, host_pool):
        page_bytes = host_pool.geom.bytes_per_page
        if page_bytes != config.page_bytes:
            raise ValueError(f"storage page_bytes {config.page_bytes} != host pool page "
                             f"bytes {page_bytes}")
        self.config = config
        self.host_pool = host_pool  # kv.host_pool.HostKVPool (flat page accessors)

    @abstractmethod
    def batch_exists(self, keys: list[str]) -> int: ...

    def exist_flags(self, keys: list[str]) -> list[bool]:
        """Whether each key is stored (not only a leading run): one batch_exists per key;
        a backend with a batched lookup overrides it."""
        return [self.batch_exists([k]) == 1 for k in keys]

    @abstractmethod
    def batch_get(self, keys: list[str], host_pages: list[int]) -> list[bool]: ...

    @abstractmethod
    def batch_set(self, keys: list[str], host_pages: list[int]) -> list[bool]: ...

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None:
        pass

    @staticmethod
    def _check_batch(keys: list[str], host_pages: list[int]) -> None:
        if len(keys) != len(host_pages):
            raise ValueError(f"{len(keys)} keys but {len(host_pages)} host pages")
