"""Free loopback ports for the servers a benchmark (or a test) starts, taken below the
kernel's ephemeral range.

Why: a port that bind(("127.0.0.1", 0)) returned is only free until that socket closes; the
kernel may give the same number to another process's bind(0) or outgoing connection (both
draw from net.ipv4.ip_local_port_range) before the server binds it, and the server then
fails to start with EADDRINUSE (seen: a PD bootstrap port in `make test`, 2026-12-03). The
kernel never hands out a port below that range by itself, and a process never hands the
same port out twice. tests/helpers/ports.py gives each test worker its own slice.
"""
from __future__ import annotations

import random
import socket

SPAN = 12288  # ports below the ephemeral range that may be handed out
_given: set[int] = set()


def ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere any free port below it will do


def below_ephemeral() -> tuple[int, int]:
    """[low, high): the ports this module hands out by default."""
    high = ephemeral_low()
    return max(1024, high - SPAN), high


def free_port(low: int | None = None, high: int | None = None) -> int:
    """A loopback port in [low, high) (default: below_ephemeral()) that binds now and that
    this process has not handed out before."""
    if low is None or high is None:
        low, high = below_ephemeral()
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
