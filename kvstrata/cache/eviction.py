"""Eviction policies for the radix cache: each maps a node to a sort key; smallest goes first.

Keys are tuples so the heap in `RadixCache.evict` can compare them directly; the node's
creation id is appended by the caller as the final tie-breaker, which makes eviction order
fully deterministic (the access clock is a logical counter, not wall time).

Kept in its own module because SGLang grew more policies over time (slru, priority, fifo);
adding one here is one function plus one table entry.
"""
from __future__ import annotations

from typing import Callable, Protocol


class _HasAccessStats(Protocol):
    last_access_time: int
    hit_count: int


def lru_priority(node: _HasAccessStats) -> tuple[int, ...]:
    # Least recently used first.
    return (node.last_access_time,)


def lfu_priority(node: _HasAccessStats) -> tuple[int, ...]:
    # Fewest hits first; among equals the least recently used, as in SGLang's LFU.
    return (node.hit_count, node.last_access_time)


EVICTION_POLICIES: dict[str, Callable[[_HasAccessStats], tuple[int, ...]]] = {
    "lru": lru_priority,
    "lfu": lfu_priority,
}


def get_priority_fn(policy: str) -> Callable[[_HasAccessStats], tuple[int, ...]]:
    try:
        return EVICTION_POLICIES[policy]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {policy!r}; choose one of {sorted(EVICTION_POLICIES)}"
        ) from None
