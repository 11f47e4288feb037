"""The recurrent-state half of a KV plan (no torch): SSM / linear-attention models (Mamba2,
Gated DeltaNet) keep, per request, a fixed-size state for each of their recurrent layers,
valid at exactly one position (SGLang's MambaPool; hybrid-models.md section 3).

A state pool has `num_state_slots` usable slots (ids 1..N; slot 0 is the padding sink, as
page 0 of a KV pool). Every slot holds every `StateComponent` of every recurrent layer:
  conv   the causal conv1d's last (kernel - 1) inputs: (conv_dim, kernel - 1)
  ssm    the recurrent state: Gated DeltaNet (num_v_heads, head_k_dim, head_v_dim),
         Mamba2 (num_heads, head_dim, d_state)
A request holds one working slot while it runs (chunked prefill carries the state in it);
the prefix cache keeps snapshots in slots of its own (a hit copies a snapshot into the
request's slot: copy-on-write, ScheduledRequest.state_copy_from).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

STATE_CONV = "conv"
STATE_SSM = "ssm"
STATE_NAMES = (STATE_CONV, STATE_SSM)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class StateComponent:
    """One per-slot tensor kept by `num_layers` recurrent layers: `slot_shape` elements of
    `dtype` per slot and layer."""
    name: str
    num_layers: int
    slot_shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.name not in STATE_NAMES or self.num_layers < 1 or not self.slot_shape \
                or min(self.slot_shape) < 1 or self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"invalid state component {self}: name one of {STATE_NAMES}, "
                             f"layers >= 1, a non-empty positive shape, dtype one of "
                             f"{', '.join(_DTYPE_BYTES)}")

    @property
    def bytes_per_slot_per_layer(self) -> int:
        return math.prod(self.slot_shape) * _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_slot(self) -> int:
        return self.bytes_per_slot_per_layer * self.num_layers

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "num_layers": self.num_layers,
                "slot_shape": list(self.slot_shape), "dtype": self.dtype,
                "bytes_per_slot_per_layer": self.bytes_per_slot_per_layer}


def state_bytes_per_slot(components: tuple[StateComponent, ...]) -> int:
    return sum(c.bytes_per_slot for c in components)


def check_state_pool(num_state_slots: int, components: tuple[StateComponent, ...]) -> None:
    """ValueError unless the state half of a plan is well formed (both or neither)."""
    if num_state_slots < 0:
        raise ValueError(f"KVPlan.num_state_slots must be >= 0, got {num_state_slots}")
    names = [c.name for c in components]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate state components {names}")
    if components and not num_state_slots:
        raise ValueError("state components without a state pool (num_state_slots 0)")
    if num_state_slots and STATE_SSM not in names and components:
        raise ValueError(f"a state pool keeps an {STATE_SSM!r} component, got {names}")
