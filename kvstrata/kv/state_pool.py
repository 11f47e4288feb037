"""The recurrent-state pool of an SSM / linear-attention model (Gated DeltaNet, Mamba2):
one slot per running request plus the prefix cache's snapshots (config/state_plan.py).

One tensor per `StateComponent` of the plan, shaped (num_layers, num_state_slots + 1,
*slot_shape): slot 0 is the padding sink (never a request's), slots 1..N are the plan's.
  conv  (conv_dim, kernel - 1): the causal conv1d's last inputs, oldest first
  ssm   Gated DeltaNet (num_v_heads, head_k_dim, head_v_dim) / Mamba2 (heads, head_dim,
        d_state), in the component's dtype (float32 by default, as SGLang's
        --mamba-ssm-dtype)
Layer-first like SGLang's MambaPool, so a layer's slots are one [slots, ...] tensor that the
recurrent kernels gather from and scatter into (runner/recurrent/). Zero-initialised: a
zeroed slot is the state before any token.

Slot-level moves: `copy_slots` (the prefix cache's copy-on-write and snapshot copies),
`zero_slots` (a request that starts from nothing), and a CPU copy of some slots and its
restore (a retraction backup that keeps the state beside the request's KV).
"""
from __future__ import annotations

import math

import torch

from kvstrata import platform
from kvstrata.config.kv_plan import KVPlan
from kvstrata.config.state_plan import STATE_CONV, STATE_SSM
from kvstrata.kv.host_pool import check_host_memory
from kvstrata.kv.layouts import KVGeometry


def slot_index(slots, num_slots: int, what: str) -> torch.Tensor:
    """`slots` as an int64 index, each in 1..num_slots - 1 (slot 0 is never a state's)."""
    idx = torch.as_tensor(slots, dtype=torch.int64).reshape(-1)
    if idx.numel() and (int(idx.min()) < 1 or int(idx.max()) >= num_slots):
        raise IndexError(f"{what} {idx.tolist()[:8]} outside 1..{num_slots - 1}")
    return idx


class RecurrentStatePool:
    def __init__(self, plan: KVPlan, device: torch.device | str):
        if not plan.state_components:
            raise ValueError("RecurrentStatePool needs a plan with state_components")
        self.plan = plan
        self.device = torch.device(device)
        self.num_slots = plan.num_state_slots + 1  # with the padding slot 0
        self.tensors: dict[str, torch.Tensor] = {
            c.name: torch.zeros((c.num_layers, self.num_slots, *c.slot_shape),
                                dtype=getattr(torch, c.dtype), device=self.device)
            for c in plan.state_components}
        layers = {c.num_layers for c in plan.state_components}
        if len(layers) != 1:
            raise ValueError(f"every state component is kept by every recurrent layer, got "
                             f"{[c.to_json() for c in plan.state_components]}")
        self.num_layers = layers.pop()

    @property
    def conv(self) -> torch.Tensor | None:
        """(layers, slots, conv_dim, kernel - 1), or None for a model without a conv."""
        return self.tensors.get(STATE_CONV)

    @property
    def ssm(self) -> torch.Tensor:
        return self.tensors[STATE_SSM]

    @property
    def size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def slots_tensor(self, slots) -> torch.Tensor:
        """`slots`, checked against the pool, as an index tensor on its device (the host
        state pool indexes the device pool through it when saving and loading)."""
        return slot_index(slots, self.num_slots, "state slots").to(self.device)

    def copy_slots(self, src, dst) -> None:
        """Every layer's state of slots `src` into slots `dst` (all sources read first)."""
        s, d = self.slots_tensor(src), self.slots_tensor(dst)
        if s.numel() != d.numel():
            raise ValueError(f"copy of {s.numel()} state slots into {d.numel()}")
        for t in self.tensors.values():
            t[:, d] = t[:, s]

    def zero_slots(self, slots) -> None:
        """The state before any token (what a request without a cached prefix starts from)."""
        idx = self.slots_tensor(slots)
        for t in self.tensors.values():
            t[:, idx] = 0

    def page_buffers(self) -> list[torch.Tensor]:
        """The pool as PD page buffers (transfer/disagg/base.py, regions.py STATE): per
        component a uint8 [layers, slots + 1, bytes of one layer's slot] view sharing its
        memory, so a state slot crosses like a KV page (SGLang's MambaPool
        get_contiguous_buf_infos: conv and ssm only)."""
        return [t.view(t.shape[0], t.shape[1], -1).view(torch.uint8)
                for t in self.tensors.values()]

    def cpu_copy(self, slots) -> dict[str, torch.Tensor]:
        """A host copy of `slots` (every component and layer), for a retraction backup."""
        idx = self.slots_tensor(slots)
        return {name: t[:, idx].to("cpu", copy=True) for name, t in self.tensors.items()}

    def restore(self, slots, copy: dict[str, torch.Tensor]) -> None:
        """Write a `cpu_copy` back into `slots` (any slots of the same count)."""
        idx = self.slots_tensor(slots)
        if set(copy) != set(self.tensors):
            raise ValueError(f"a state copy of {sorted(copy)} cannot restore "
                             f"{sorted(self.tensors)}")
        for name, t in self.tensors.items():
            if copy[name].shape[1] != idx.numel():
                raise ValueError(f"a copy of {copy[name].shape[1]} slots into {idx.numel()}")
            t[:, idx] = copy[name].to(t.device, t.dtype)


class HostStatePool:
    """HiCache L2 of a recurrent model: host copies of state pool slots (snapshots whose
    device copy went, cache/state_hiradix.py), pinned on CUDA/ROCm like the host KV pool.
    Copies are sync: the HiCache executor makes them in op order before the step's forward.

    Slot-major: one uint8 buffer of (num_host_state_slots + 1) rows (row 0 unused), a row
    holding every component of every layer of one slot, so that HiCache L3 stores a slot as
    one record (cache/state_storage.py): `geom`, `device_order`, `check_page_ids`,
    `get_flat_pages` and `set_flat_pages` make the slots look to a storage backend like host
    pages of one section, layer, token and head (kv/storage/base.py). `tensors` keeps the
    device pool's per-component shape (num_layers, slots, *slot_shape) as views of it."""

    def __init__(self, plan: KVPlan, pin_memory: bool | None = None,
                 check_memory: bool = True):
        if not plan.num_host_state_slots or not plan.state_components:
            raise ValueError("HostStatePool needs a plan with host state slots and state "
                             "components")
        if check_memory:  # as the host KV pool: fail at start-up, not mid-serving
            check_host_memory((plan.num_host_state_slots + 1) * plan.state_bytes_per_slot,
                              "--hicache-mamba-size-gb (or --hicache-ratio / --hicache-size)")
        if pin_memory is None:
            pin_memory = platform.is_cuda_alike()
        self.num_slots = plan.num_host_state_slots + 1
        # Widest elements first, each component at an offset of its element size and the row
        # padded to the widest one, so every component's bytes view as its dtype (no padding
        # for the usual float32 ssm + bfloat16 / float32 conv).
        def itemsize(c) -> int:
            return torch.empty((), dtype=getattr(torch, c.dtype)).element_size()

        def nbytes(c) -> int:
            return c.num_layers * math.prod(c.slot_shape) * itemsize(c)

        offsets, row = {}, 0
        for c in sorted(plan.state_components, key=lambda c: -itemsize(c)):
            row = -(-row // itemsize(c)) * itemsize(c)
            offsets[c.name] = row
            row += nbytes(c)
        widest = max(itemsize(c) for c in plan.state_components)
        self.slot_bytes = -(-row // widest) * widest
        self.records = torch.zeros((self.num_slots, self.slot_bytes), dtype=torch.uint8,
                                   pin_memory=pin_memory)
        self.tensors: dict[str, torch.Tensor] = {}
        for c in plan.state_components:
            part = self.records[:, offsets[c.name]:offsets[c.name] + nbytes(c)]
            self.tensors[c.name] = part.view(getattr(torch, c.dtype)).view(
                self.num_slots, c.num_layers, *c.slot_shape).transpose(0, 1)
        self.geom = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=self.slot_bytes,
                               page_size=1, dtype=torch.uint8, num_sections=1)

    @property
    def size_bytes(self) -> int:
        return self.records.numel()

    def slots_tensor(self, slots) -> torch.Tensor:
        """`slots`, checked against the host pool, as an index tensor."""
        return slot_index(slots, self.num_slots, "host state slots")

    def save(self, pool: RecurrentStatePool, device_slots, host_slots) -> None:
        """Device state slots -> host state slots (pairwise, every component and layer)."""
        d, h = pool.slots_tensor(device_slots), self.slots_tensor(host_slots)
        if d.numel() != h.numel():
            raise ValueError(f"a copy of {d.numel()} state slots into {h.numel()}")
        for name, t in self.tensors.items():
            t[:, h] = pool.tensors[name][:, d].to("cpu")

    def load(self, pool: RecurrentStatePool, device_slots, host_slots) -> None:
        """Host state slots -> device state slots (pairwise)."""
        d, h = pool.slots_tensor(device_slots), self.slots_tensor(host_slots)
        if d.numel() != h.numel():
            raise ValueError(f"a copy of {h.numel()} host state slots into {d.numel()}")
        for name, t in pool.tensors.items():
            t[:, d] = self.tensors[name][:, h].to(t.device)

    # ---- a storage backend's view: one slot = one flat "page" of slot_bytes bytes ------------
    def device_order(self) -> torch.Tensor:
        """(1, 1, slots, 1, 1, slot_bytes) view of the records (FlatPageStaging's order)."""
        return self.records.view(1, 1, self.num_slots, 1, 1, self.slot_bytes)

    def check_page_ids(self, slots: torch.Tensor) -> None:
        slot_index(slots, self.num_slots, "host state slots")

    def get_flat_pages(self, slots) -> torch.Tensor:
        """(n, slot_bytes) uint8 copy of host state `slots`."""
        return self.records[self.slots_tensor(slots)].clone()

    def set_flat_pages(self, slots, flat: torch.Tensor) -> None:
        """Write (n, slot_bytes) uint8 records into host state `slots`."""
        idx = self.slots_tensor(slots)
        if flat.shape != (idx.numel(), self.slot_bytes) or flat.dtype != torch.uint8:
            raise ValueError(f"expected state records of shape ({idx.numel()}, "
                             f"{self.slot_bytes}) uint8, got {tuple(flat.shape)} {flat.dtype}")
        self.records[idx] = flat
