"""A stress test of the GGUF worker pool's call protocol (runner/cpu/csrc/gguf_pool.h).

The race fixed in 9d7cda7 needed a worker descheduled between finishing the last chunk of
one call and reading the next call's fields: it then claimed a chunk of the new call under
the old claim word, counted it in the new call's `done`, and the caller returned while a
chunk still ran on its finished job (a SIGSEGV in 2 of 3 servers, never in a unit test).
Here the pool's test pauses (_gguf_ops.pool_delays) open that window on every call: each
worker sleeps after each chunk it finishes, the caller sleeps between publishing a call's
fields and its claim word. Calls alternate between a weight of few chunks and one of many
(the late worker's stale index must fall inside the new call). Under them, every call must
give the bits of the pool-less split, and once the workers are idle every chunk must have
run exactly once (the pool's running counts: chunks called == chunks run; a stale chunk runs
twice). The protocol before the fix fails the count here and crashes now and then: the
calls run in a child process, so a crash is a failed test, not a dead test worker."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvstrata.runner.cpu import gguf_matmul

needs_avx2 = pytest.mark.skipif(not gguf_matmul._own(1),
                                reason="the GGUF kernels need AVX2 + FMA + F16C")

CHILD = r"""
import sys, time
import numpy as np, torch
from kvstrata.bench.gguf_blocks import weight_rows
from kvstrata.runner.cpu import gguf_matmul, _gguf_ops

calls, worker_us, caller_us = (int(a) for a in sys.argv[1:4])
# Q4_1 rows of 576 (SmolLM2's width): 640 rows is just over the 256 KiB split threshold
# (~12 chunks at one row), 4096 rows many more.
weights = [gguf_matmul.prepare(3, weight_rows(3, n, 576, np.random.default_rng(n)))
           for n in (640, 4096)]
gen = torch.Generator().manual_seed(0)
xs = [torch.randn(4, 576, generator=gen) for _ in range(8)]
torch.set_num_threads(3)  # two workers beside the caller, on however many cores
_gguf_ops.use_pool(False)  # the reference: the OpenMP split (bit-identical by design)
want = {(w, i, m): gguf_matmul.matmul(xs[i][:m], weights[w])
        for w in range(2) for i in range(8) for m in range(1, 5)}
_gguf_ops.use_pool(True)
_gguf_ops.pool_delays(worker_us, caller_us)
wrong = []
for c in range(calls):
    w, i, m = c % 2, (c // 2) % 8, 1 + (c // 16) % 4
    if not torch.equal(gguf_matmul.matmul(xs[i][:m], weights[w]), want[(w, i, m)]):
        wrong.append(c)
time.sleep(0.05)  # every worker past its last pause
called, run = _gguf_ops.pool_counts()
_gguf_ops.pool_delays(0, 0)
print(f"calls {calls}: {len(wrong)} wrong, {called} chunks called, {run} run")
sys.exit(1 if wrong or run != called else 0)
"""


@needs_avx2
@pytest.mark.parametrize("worker_us,caller_us", [(200, 500), (50, 200)])
def test_late_workers_never_touch_the_next_call(worker_us, caller_us):
    out = subprocess.run([sys.executable, "-c", CHILD, "160", str(worker_us), str(caller_us)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
