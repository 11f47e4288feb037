"""KVPlan: the one description of the KV cache's geometry and capacity (no torch).

Computed once at start-up by `config.kv_sizing.size_kv_plan` (the engine factory calls it
after resolution and after the model is loaded) and handed to everything that lays out or
counts KV: the model runner (device pool, req_to_token, host pool, IO backend), the scheduler
and the KV manager. PD transfer (per-layer page bytes to register), the decode-retraction
backup and the MLA / DSA-indexer pools read their geometry from it too. Nothing else derives
page counts or byte sizes; the plan checks its own consistency, once, when it is built.

A pool kind is a tuple of `KVComponent`s: the per-token tensors every layer keeps.
  mha   k (H, D) and v (H, D)                         in the KV dtype
  mla   kv_latent (1, kv_lora_rank + qk_rope_head_dim) in the KV dtype
  + DSA index_k the indexer's key per token, next to either kind: (index_head_dim,) in
        the KV dtype on our torch path (what the fp32 reference computes); SGLang's CUDA
        layout is (index_head_dim + 4 * index_head_dim / 128,) uint8 (fp8 keys and fp32
        scales per 128-element block), which a plan can describe too (docs/dsa.md)
  swa   hybrid SWA memory: mha K/V of the full-attention layers in `components` (none for an
        all-SWA model) and of the sliding-window layers in `swa_components`, a second pool of
        `num_swa_pages` (config/kv_sizing_swa.py sizes both; `full_pool_plan()` and
        `swa_pool_plan()` are what the runner allocates)
Page 0 of each pool and req_to_token row 0 are padding sinks allocated on top of the usable
`num_pages` / `num_rows`.

The host memory layout names and which IO backend can move which layout (the resolver's
rules, `--hicache-mem-layout` choices and the IO backends read them), the components and the
dtypes' sizes live in config/kv_components.py and are re-exported here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvstrata.config.state_plan import StateComponent, check_state_pool, state_bytes_per_slot

# The components, dtypes and host layouts (config/kv_components.py), re-exported: callers
# import them from here
from kvstrata.config.kv_components import (  # noqa: F401
    DSA_INDEX_K, DTYPE_BYTES, EAGLE_HIDDEN, HOST_LAYOUTS, IO_BACKEND_LAYOUTS, IO_BACKENDS,
    LAYER_FIRST, MHA_K, MHA_V, MLA_LATENT, PAGE_FIRST, PAGE_FIRST_DIRECT, PAGE_HEAD, POOL_KINDS,
    KVComponent, check_host_layout_io, mha_components, mla_components, page_bytes)


@dataclass(frozen=True)
class KVPlan:
    """KV geometry and capacity of one model replica. Frozen; built once at start-up."""
    page_size: int            # tokens per page, on every tier
    num_pages: int            # usable device pages (ids 1..num_pages; page 0 is the sink)
    num_rows: int             # req_to_token rows = max running requests (row 0 is the sink)
    context_len: int          # positions per req_to_token row
    pool_kind: str = "mha"    # key of POOL_KINDS
    components: tuple[KVComponent, ...] = ()
    num_host_pages: int = 0   # usable host pages; 0 = no host pool
    host_layout: str | None = None
    io_backend: str | None = None
    host_size_flag: str = "--hicache-ratio"  # the flag that sized the host pool (errors)
    # What the host pool is for: "hicache" (L2 behind the radix tree) or "retraction" (a
    # decode server's KV backups, --disaggregation-decode-retraction-backup host_pool).
    host_pool_use: str = "hicache"
    # STANDALONE / EAGLE speculative decoding: the draft's own K/V per token (an mha pool
    # over the same slots, runner/spec/standalone.py; an EAGLE head also keeps EAGLE_HIDDEN);
    # device only, never on the host tier.
    draft_components: tuple[KVComponent, ...] = ()
    # Hybrid SWA memory (SGLang's SWAKVPool): the sliding-window layers keep their K/V in a
    # second device pool of num_swa_pages pages (`swa_components`; `components` then holds
    # the full-attention layers only, none for an all-SWA model). Full page ids stay the
    # canonical address of a token (req_to_token, the radix tree); the KV manager maps each
    # full page to an SWA page and frees SWA pages that fall out of every window
    # (cache/kv_manager.py). 0 = no SWA pool: every layer in the main pool.
    num_swa_pages: int = 0
    swa_window: int = 0       # the widest window of the layers in the SWA pool (tokens)
    swa_components: tuple[KVComponent, ...] = ()
    # Recurrent state (SSM / linear-attention layers; config/state_plan.py): a pool of
    # num_state_slots slots (ids 1..N, slot 0 the padding sink), each holding every
    # `state_components` tensor of every recurrent layer; `components` then holds the
    # full-attention layers only. 0 = the model keeps no state. num_state_slots bounds the
    # requests that run at once (each holds one working slot) plus the prefix cache's
    # snapshots. `state_components` empty with slots > 0 = bookkeeping only (fake runners).
    num_state_slots: int = 0
    state_components: tuple[StateComponent, ...] = ()
    # ... and with HiCache L2 (cache/state_hiradix.py): host state slots (each one state
    # pool slot's bytes) keeping copies of snapshots whose device copy went.
    num_host_state_slots: int = 0
    # False for a model whose layers are all recurrent (Mamba2): its page ids still name
    # every token (req_to_token, the radix tree, HiCache's host pages, storage keys) but
    # hold no K/V, so a page copy moves nothing and only state snapshots carry bytes
    # (cache/state_hiradix.py, runner/executors/hicache.py).
    pages_hold_kv: bool = True

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "num_rows", "context_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVPlan.{name} must be >= 1, got {getattr(self, name)}")
        if self.pool_kind not in POOL_KINDS:
            raise ValueError(f"unknown KV pool kind {self.pool_kind!r}")
        names = tuple(c.name for c in self.components)
        required = POOL_KINDS[self.pool_kind]
        if self.pool_kind == "swa":
            required = POOL_KINDS["mha"]
            if names not in ((), required) or not self.num_swa_pages or tuple(
                    c.name for c in self.swa_components) != required:
                raise ValueError(f"an swa pool keeps {required} or nothing for its full "
                                 f"layers and {required} in an SWA pool of num_swa_pages > 0, "
                                 f"got {names}, {self.swa_components}, "
                                 f"{self.num_swa_pages} SWA pages")
        elif names[:len(required)] != required or len(set(names)) != len(names) or (
                self.pool_kind == "none" and names):
            raise ValueError(f"a {self.pool_kind} pool keeps {required} (then optionally "
                             f"{DSA_INDEX_K}), got {names}")
        for c in self.components + self.swa_components:
            if c.dtype not in DTYPE_BYTES or c.num_layers < 1 or min(c.token_shape) < 1:
                raise ValueError(f"invalid KV component {c}")
        draft_names = tuple(c.name for c in self.draft_components)
        # NEXTN: an MLA layer (DeepSeek-V3), or an MLA + DSA one (V3.2)
        mtp = POOL_KINDS["mla"] + (EAGLE_HIDDEN,)
        mtp_dsa = POOL_KINDS["mla"] + (DSA_INDEX_K, EAGLE_HIDDEN)
        if draft_names and draft_names not in (POOL_KINDS["mha"],
                                               POOL_KINDS["mha"] + (EAGLE_HIDDEN,), mtp,
                                               mtp_dsa):
            raise ValueError(f"a draft pool keeps {POOL_KINDS['mha']} (an EAGLE head also "
                             f"{EAGLE_HIDDEN}; an MTP layer {mtp} or {mtp_dsa}), got "
                             f"{self.draft_components}")
        if self.num_swa_pages < 0 or (self.num_swa_pages > 0) != (self.swa_window > 0):
            raise ValueError("an SWA pool needs both num_swa_pages and swa_window (> 0), got "
                             f"{self.num_swa_pages} pages, window {self.swa_window}")
        if self.swa_components and not self.num_swa_pages:
            raise ValueError("SWA components without an SWA pool (num_swa_pages 0)")
        check_state_pool(self.num_state_slots, self.state_components)
        if self.num_host_state_slots and not (self.num_state_slots and self.num_host_pages):
            raise ValueError("host state slots need a state pool and a host pool")
        if not self.pages_hold_kv and (self.components or self.pool_kind != "none"
                                       or not self.num_state_slots):
            raise ValueError("pages without K/V are a model whose layers are all recurrent: "
                             "pool kind none, no components, a state pool")
        if self.num_host_pages < 0:
            raise ValueError(f"KVPlan.num_host_pages must be >= 0, got {self.num_host_pages}")
        if self.host_pool_use not in ("hicache", "retraction"):
            raise ValueError(f"KVPlan.host_pool_use must be hicache or retraction, got "
                             f"{self.host_pool_use!r}")
        if self.num_host_pages:
            if self.host_layout is None or self.io_backend is None:
                raise ValueError("a host pool needs a host layout and an IO backend")
            check_host_layout_io(self.host_layout, self.io_backend)

    # ---- built for tests and tools (the server's plan comes from kv_sizing) ---------------
    @classmethod
    def mha(cls, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
            page_size: int, num_pages: int, num_rows: int = 64, context_len: int = 4096,
            **host: Any) -> "KVPlan":
        return cls(page_size, num_pages, num_rows, context_len, "mha",
                   mha_components(num_layers, num_kv_heads, head_dim, dtype), **host)

    @classmethod
    def pages_only(cls, *, num_pages: int, page_size: int = 1, num_rows: int = 64,
                   context_len: int = 1 << 20, num_host_pages: int = 0,
                   host_pool_use: str = "hicache", num_swa_pages: int = 0,
                   swa_window: int = 0, num_state_slots: int = 0,
                   num_host_state_slots: int = 0, pages_hold_kv: bool = True) -> "KVPlan":
        """Page bookkeeping without tensors: for the torch-free scheduler and fake runners.
        A host tier here only needs a (any valid) layout/IO pair to be well formed."""
        host = dict(num_host_pages=num_host_pages, host_layout=PAGE_FIRST, io_backend="kernel",
                    host_pool_use=host_pool_use) if num_host_pages else {}
        return cls(page_size, num_pages, num_rows, context_len, "none", (), **host,
                   num_swa_pages=num_swa_pages, swa_window=swa_window,
                   num_state_slots=num_state_slots, num_host_state_slots=num_host_state_slots,
                   pages_hold_kv=pages_hold_kv)

    # ---- derived numbers -------------------------------------------------------------------
    @property
    def max_total_tokens(self) -> int:
        """Usable device tokens (the padding page excluded)."""
        return self.num_pages * self.page_size

    @property
    def has_host_pool(self) -> bool:
        return self.num_host_pages > 0

    @property
    def has_swa_pool(self) -> bool:
        return self.num_swa_pages > 0

    @property
    def has_state_pool(self) -> bool:
        return self.num_state_slots > 0

    @property
    def state_bytes_per_slot(self) -> int:
        return state_bytes_per_slot(self.state_components)

    @property
    def state_pool_bytes(self) -> int:
        """The state pool's tensors, the padding slot included."""
        return (self.num_state_slots + 1) * self.state_bytes_per_slot if \
            self.num_state_slots else 0

    @property
    def dtype(self) -> str | None:
        """Storage dtype of the main pool (K/V or latent); None without tensors."""
        comps = self.components or self.swa_components  # all-SWA: the SWA pool's
        return comps[0].dtype if comps else None

    @property
    def num_layers(self) -> int:
        return max((c.num_layers for c in self.components), default=0)

    def component(self, name: str) -> KVComponent:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"the {self.pool_kind} KV pool has no {name!r} component "
                       f"(has {[c.name for c in self.components]})")

    def bytes_per_page_per_layer(self, name: str) -> int:
        return self.component(name).bytes_per_page_per_layer(self.page_size)

    @property
    def section_bytes_per_token_per_layer(self) -> int:
        """One token of one layer in one section of the pool tensor: K (or V) for MHA; for
        MLA every component, which the pool stores side by side in one row."""
        if self.pool_kind == "mla":
            return sum(c.bytes_per_token_per_layer for c in self.components)
        return self.component(MHA_K).bytes_per_token_per_layer

    @property
    def bytes_per_token(self) -> int:
        """Every component of every layer for one token (what sizes the pools)."""
        return sum(c.bytes_per_token for c in self.components)

    @property
    def draft_bytes_per_token(self) -> int:
        return sum(c.bytes_per_token for c in self.draft_components)

    def draft_plan(self) -> "KVPlan":
        """The draft model's pool: same pages, rows and context, the draft's components."""
        if not self.draft_components:
            raise ValueError("this KV plan has no draft pool")
        comps = tuple(c for c in self.draft_components if c.name != EAGLE_HIDDEN)
        kind = "mla" if any(c.name == MLA_LATENT for c in comps) else "mha"  # MTP: MLA
        return KVPlan(self.page_size, self.num_pages, self.num_rows, self.context_len, kind,
                      comps)

    @property
    def bytes_per_page(self) -> int:
        return page_bytes(self.components, self.page_size)

    @property
    def swa_bytes_per_token(self) -> int:
        return sum(c.bytes_per_token for c in self.swa_components)

    @property
    def max_swa_tokens(self) -> int:
        """Usable tokens of the SWA pool (0 without one)."""
        return self.num_swa_pages * self.page_size

    @property
    def device_pool_bytes(self) -> int:
        """The device pools' tensors, padding pages included (the SWA pool's too)."""
        swa = ((self.num_swa_pages + 1) * page_bytes(self.swa_components, self.page_size)
               if self.swa_components else 0)
        return (self.num_pages + 1) * self.bytes_per_page + swa

    # ---- hybrid SWA memory: each device pool as a plain mha plan (what the runner builds)
    def full_pool_plan(self) -> "KVPlan | None":
        """The full-attention layers' pool (None for an all-SWA plan: its full page ids are
        addresses only, no tensors); `self` when this plan has no SWA pool."""
        if self.pool_kind != "swa":
            return self
        if not self.components:
            return None
        return KVPlan(self.page_size, self.num_pages, self.num_rows, self.context_len, "mha",
                      self.components, **self._host_fields())

    def _host_fields(self) -> dict[str, Any]:
        # A host tier keeps both halves of a page under one host page id
        # (cache/swa_hiradix.py): each pool's plan names the same host page count.
        if not self.num_host_pages:
            return {}
        return dict(num_host_pages=self.num_host_pages, host_layout=self.host_layout,
                    io_backend=self.io_backend, host_size_flag=self.host_size_flag,
                    host_pool_use=self.host_pool_use)

    def swa_pool_plan(self) -> "KVPlan":
        """The sliding-window layers' pool: num_swa_pages pages of swa_components."""
        if not self.swa_components:
            raise ValueError("this KV plan has no SWA pool")
        return KVPlan(self.page_size, self.num_swa_pages, self.num_rows, self.context_len,
                      "mha", self.swa_components, **self._host_fields())

    @property
    def host_pool_bytes(self) -> int:
        swa = page_bytes(self.swa_components, self.page_size)  # the host SWA half, if any
        states = (self.num_host_state_slots + 1) * self.state_bytes_per_slot \
            if self.num_host_state_slots else 0
        return (self.num_host_pages + 1) * (self.bytes_per_page + swa) + states \
            if self.num_host_pages else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "page_size": self.page_size, "num_pages": self.num_pages,
            "max_total_tokens": self.max_total_tokens, "num_rows": self.num_rows,
            "context_len": self.context_len, "pool_kind": self.pool_kind, "dtype": self.dtype,
            "components": [c.to_json() for c in self.components],
            "bytes_per_token": self.bytes_per_token,
            "device_pool_bytes": self.device_pool_bytes,
            "num_host_pages": self.num_host_pages, "host_layout": self.host_layout,
            "io_backend": self.io_backend, "host_pool_bytes": self.host_pool_bytes,
            "host_pool_use": self.host_pool_use if self.num_host_pages else None,
            "draft_components": [c.to_json() for c in self.draft_components],
            "draft_bytes_per_token": self.draft_bytes_per_token,
            "num_swa_pages": self.num_swa_pages, "swa_window": self.swa_window,
            "max_swa_tokens": self.max_swa_tokens,
            "swa_bytes_per_token": self.swa_bytes_per_token,
            "swa_components": [c.to_json() for c in self.swa_components],
            "num_state_slots": self.num_state_slots,
            "state_bytes_per_slot": self.state_bytes_per_slot,
            "state_components": [c.to_json() for c in self.state_components],
            "num_host_state_slots": self.num_host_state_slots,
            "pages_hold_kv": self.pages_hold_kv,
        }

    def summary(self) -> str:
        """One start-up log line."""
        host = (f"; host {self.num_host_pages} pages"
                + (f" + {self.num_host_state_slots} state slots" if self.num_host_state_slots
                   else "")
                + f" ({self.host_pool_bytes / 2**20:.1f} MiB, {self.host_layout}/"
                  f"{self.io_backend})" if self.num_host_pages else "")
        draft = (f"; draft pool {self.draft_bytes_per_token} B/token"
                 if self.draft_components else "")
        swa = (f"; SWA pool {self.num_swa_pages} pages x {self.page_size} tokens "
               f"({self.swa_bytes_per_token} B/token, window {self.swa_window}, "
               f"{self.swa_components[0].num_layers} layers)" if self.swa_components else "")
        state = (f"; state pool {self.num_state_slots} slots x {self.state_bytes_per_slot} B"
                 if self.num_state_slots else "")
        return (f"KV plan: {self.pool_kind} {self.dtype}, {self.num_pages} pages x "
                f"{self.page_size} tokens ({self.device_pool_bytes / 2**20:.1f} MiB, "
                f"{self.bytes_per_token} B/token), {self.num_rows} rows x "
                f"{self.context_len}{swa}{state}{host}{draft}")
