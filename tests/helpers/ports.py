"""Free loopback ports for the tests' servers, taken below the kernel's ephemeral range.

Why: a port that bind(("127.0.0.1", 0)) returned is only free until that socket closes; the
kernel may give the same number to another process's bind(0) or outgoing connection (both
draw from net.ipv4.ip_local_port_range) before the server binds it, and the server then
fails to start with EADDRINUSE (seen: a PD bootstrap port in `make test`, 2026-12-03). The
kernel never hands out a port below that range by itself; each xdist worker draws from its
own slice of those ports, and a process never hands the same port out twice, so the two
test workers cannot race each other either. Always import this module as
`tests.helpers.ports` (one module object: one record of what was handed out).
"""
from __future__ import annotations

import os
import random
import socket

SPAN = 12288  # ports below the ephemeral range that the tests may use
_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere any free port below it will do


def worker_slice() -> tuple[int, int]:
    """[low, high) of the ports this test process may hand out."""
    high = _ephemeral_low()
    low = max(1024, high - SPAN)
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(name[2:]) if name[2:].isdigit() else 0
    size = (high - low) // count
    return low + index % count * size, low + (index % count + 1) * size


def free_port() -> int:
    low, high = worker_slice()
    for _ in range(500):
        port = random.randrange(low, high)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free loopback port in [{low}, {high})")
