"""The packed GGUF GEMMs' own worker threads (runner/cpu/csrc/gguf_pool.h): a call of up to
POOL_MAX_ROWS rows over 256 KiB of weights is cut into chunks that the caller and the pool's
workers claim; larger calls split over torch's OpenMP team. Whichever thread computes a chunk,
each output is computed whole in one order, so:

- every row count, thread count and kernel gives the bits of the one-thread call, with the
  pool on and with it off (`_gguf_ops.use_pool(False)`: the OpenMP split), on weights big
  enough to be split (the kernel tests' weights are smaller than the split threshold);
- two Python threads calling at once get their own results (one call at a time);
- a forked child, whose parent's workers do not exist in it, still computes every chunk
  (the caller never waits for a worker that has not started)."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from kvstrata.bench.gguf_blocks import weight_rows
from kvstrata.runner.cpu import _gguf_ops, gguf_matmul

needs_avx2 = pytest.mark.skipif(not gguf_matmul._own(1),
                                reason="the GGUF kernels need AVX2 + FMA + F16C")
# (qtype, out, in): Q4_1 as SmolLM2's gate|up rows of 576 (369 KiB), Q8_0, Q6_K (256-blocks);
# each over the 256 KiB above which a call is split
SHAPES = [(3, 1027, 576), (8, 515, 512), (14, 330, 1024)]
ROWS = (1, 2, 3, 4, 5, 65)  # 1-4: the pool; 5+: OpenMP; 65: a second block of 64 rows
KERNELS = ("matmul", "matmul_q8")


@pytest.fixture(scope="module")
def cases() -> list:
    """(kernel, weight, x, the one-thread result) per kernel and shape."""
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for q, n, k in SHAPES:
            w = gguf_matmul.prepare(q, weight_rows(q, n, k, np.random.default_rng(q)))
            assert w.nbytes > 256 << 10
            x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(q))
            for kernel in KERNELS:
                mm = getattr(gguf_matmul, kernel)
                out.append((mm, w, x, {m: mm(x[:m], w) for m in ROWS}))
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    _gguf_ops.use_pool(True)


@needs_avx2
@pytest.mark.parametrize("pool", [True, False], ids=["pool", "openmp"])
def test_every_split_gives_the_one_thread_bits(cases, pool, restore_threads):
    _gguf_ops.use_pool(pool)
    for threads in (2, 3, 5):
        torch.set_num_threads(threads)
        for mm, w, x, expected in cases:
            for m in ROWS:
                assert torch.equal(mm(x[:m], w), expected[m]), (mm.__name__, w.qtype, threads, m)


@needs_avx2
def test_two_python_threads_at_once(cases, restore_threads):
    torch.set_num_threads(2)
    failures = []

    def caller(offset: int) -> None:
        for i in range(40):
            mm, w, x, expected = cases[(i + offset) % len(cases)]
            m = ROWS[(i + offset) % 4]  # pool-sized calls
            if not torch.equal(mm(x[:m], w), expected[m]):
                failures.append((offset, i))
    threads = [threading.Thread(target=caller, args=(o,)) for o in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


@needs_avx2
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_computes_without_its_parents_workers(cases, restore_threads):
    torch.set_num_threads(2)
    mm, w, x, expected = cases[0]
    assert torch.equal(mm(x[:1], w), expected[1])  # the parent's workers are started
    pid = os.fork()
    if pid == 0:  # the child: no pool workers until a call starts them again
        code = 1
        try:  # pool-sized calls only: libgomp's team does not survive a fork
            code = 0 if all(torch.equal(mm(x[:m], w), expected[m]) for m in ROWS[:4]) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
