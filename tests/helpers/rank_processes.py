"""Tests that run a model's tensor-parallel ranks as real processes (spawned, one gloo group
on 127.0.0.1): start them, collect what they put on a queue, see them exit cleanly."""
from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable

from tests.helpers.ports import free_port


def results_from_ranks(target: Callable[..., None], size: int, args: tuple, count: int,
                       timeout_s: float = 180.0) -> list[Any]:
    """`size` processes each run target(rank, size, port, *args, queue) and put results on
    the queue (plain lists: a torch tensor in a Queue is shared through a file descriptor
    that dies with its process); the first `count` results, once every process exited 0."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, size, port, *args, out)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = [out.get(timeout=timeout_s) for _ in range(count)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return got
