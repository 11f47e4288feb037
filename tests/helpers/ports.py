"""Free loopback ports for the tests' servers: kvstrata.bench.ports (below the kernel's
ephemeral range, never one twice in a process), each xdist worker drawing from its own slice
so that the two test workers cannot race each other either. Always import this module as
`tests.helpers.ports`.
"""
from __future__ import annotations

import os

from kvstrata.bench import ports


def worker_slice() -> tuple[int, int]:
    """[low, high) of the ports this test process may hand out."""
    low, high = ports.below_ephemeral()
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(name[2:]) if name[2:].isdigit() else 0
    size = (high - low) // count
    return low + index % count * size, low + (index % count + 1) * size


def free_port() -> int:
    return ports.free_port(*worker_slice())
