"""kvstrata/bench/ports.py and tests/helpers/ports.py: ports below the kernel's ephemeral
range, one slice per xdist worker, never the same port twice in a process, never one that is
taken."""
from __future__ import annotations

import socket

from kvstrata.bench import ports as bench_ports
from tests.helpers import ports


def test_ports_stay_in_this_workers_slice_below_the_ephemeral_range(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    low, high = ports.worker_slice()
    assert high <= bench_ports.ephemeral_low() and high - low >= 1024
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    low0, high0 = ports.worker_slice()
    assert high0 <= low  # the other worker's slice does not overlap
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == 50 and all(low0 <= p < high0 for p in picked)


def test_a_taken_port_is_skipped(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    low, _ = ports.worker_slice()
    with socket.socket() as held:
        held.bind(("127.0.0.1", low))
        held.listen()
        choices = iter([low, low + 1, low + 2])
        monkeypatch.setattr(bench_ports.random, "randrange", lambda a, b: next(choices))
        monkeypatch.setattr(bench_ports, "_given", set())
        assert ports.free_port() in (low + 1, low + 2)


def test_bench_ports_default_to_below_the_ephemeral_range():
    low, high = bench_ports.below_ephemeral()
    assert high == bench_ports.ephemeral_low() and low < high
    picked = {bench_ports.free_port() for _ in range(20)}
    assert len(picked) == 20 and all(low <= p < high for p in picked)
