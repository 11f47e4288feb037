"""The shared-memory collectives of tensor-parallel ranks (runner/parallel/shm_allreduce.py)
and the rule that picks them. Ranks are threads here (each maps the file as a process
would); tests/correctness/test_tp_serving.py runs them between real rank processes."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from kvstrata.runner.parallel.shm_allreduce import ShmCollectives
from kvstrata.runner.parallel.tp_comm import SHM_SLOT_BYTES, collectives_backend

SLOT = 1 << 16


def ranks(size: int) -> list[ShmCollectives]:
    path = ShmCollectives.new_path()
    first = ShmCollectives(0, size, path, SLOT, create=True)
    rest = [ShmCollectives(r, size, path, SLOT, create=False) for r in range(1, size)]
    os.unlink(path)
    return [first, *rest]


def run_all(group: list[ShmCollectives], fn) -> list:
    out: list = [None] * len(group)

    def body(r: int) -> None:
        out[r] = fn(group[r], r)
    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(group))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_sums_in_rank_order_on_every_rank(size, dtype):
    group = ranks(size)
    for step in range(5):  # both buffers, several times
        inputs = [torch.randn(7, 33).to(dtype) for _ in range(size)]
        want = inputs[0].float()
        for t in inputs[1:]:
            want = want + t.float()
        got = run_all(group, lambda shm, r: shm.all_reduce(inputs[r].clone()))
        for g in got:
            assert torch.equal(g, got[0])  # the same bits everywhere
            torch.testing.assert_close(g, want.to(dtype))


def test_all_gather_last_concatenates_in_rank_order():
    group = ranks(3)
    parts = [torch.full((4, 5), float(r)) for r in range(3)]
    got = run_all(group, lambda shm, r: shm.all_gather_last(parts[r]))
    for g in got:
        assert torch.equal(g, torch.cat(parts, dim=-1))


def test_a_missing_rank_fails_the_wait_with_its_name():
    shm = ranks(2)[0]
    shm.timeout_s = 0.2
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not reach collective 1"):
        shm.all_reduce(torch.ones(3))
    shm.abort_reason = "rank 1 (pid 7) exited with code -9"
    with pytest.raises(RuntimeError, match="rank 1 .* exited"):
        shm.all_reduce(torch.ones(3))


def test_fits_counts_bytes():
    shm = ranks(2)[0]
    assert shm.fits(torch.empty(SLOT // 4))
    assert not shm.fits(torch.empty(SLOT // 4 + 1))


ROOM = 1 << 30


@pytest.mark.parametrize("args,want", [
    (("cuda", 1, "x86_64", ROOM, 2), "nccl"),
    (("cpu", 1, "x86_64", ROOM, 2), "shm"),
    (("cpu", 2, "x86_64", ROOM, 2), "gloo"),          # ranks on several machines
    (("cpu", 1, "aarch64", ROOM, 2), "gloo"),         # the barrier relies on x86 ordering
    (("cpu", 1, "x86_64", 2 * SHM_SLOT_BYTES, 2), "gloo"),  # /dev/shm too small
    (("npu", 1, "x86_64", ROOM, 2), "gloo"),
])
def test_collectives_backend_rule(args, want):
    assert collectives_backend(*args) == want
    if want == "shm":
        assert collectives_backend(*args, allow_shm=False) == "gloo"


def test_allreduce_benchmark_reports_both_paths_against_memcpy():
    from kvstrata.bench.allreduce import BATCHES, DTYPES, run

    result = run(size=2, hidden=64, layers=2, iters=5)
    assert len(result["rows"]) == len(BATCHES) * len(DTYPES)
    for row in result["rows"]:
        assert row["gloo_us"] > 0 and row["shm_us"] > 0 and row["memcpy_us"] > 0
        assert row["per_step_ms_shm"] == pytest.approx(row["shm_us"] * 5 / 1e3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_path_gives_the_python_paths_bits(monkeypatch, dtype):
    """A contiguous fp32 / bf16 tensor takes the C all-reduce (runner/cpu/csrc/cpu_ops.c), any
    other the torch one: the same protocol and the same rank-order fp32 sum, so the same
    bits -- on every instruction set (AVX-512 body, scalar tail)."""
    group = ranks(3)
    inputs = [torch.randn(5, 37).to(dtype) for _ in range(3)]
    by_python = run_all(group, lambda shm, r: shm.all_reduce(
        inputs[r].t().clone().t()).contiguous())          # strided: the torch path
    for isa in ("avx512", "scalar"):
        monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
        by_c = run_all(group, lambda shm, r: shm.all_reduce(inputs[r].clone()))
        for c, py in zip(by_c, by_python):
            assert torch.equal(c, py), isa
