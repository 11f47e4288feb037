"""The recurrent-state pool (kv/state_pool.py) against plain torch indexing: shapes from the
plan, slot copies (copy-on-write and snapshots), zeroing, a CPU copy restored elsewhere, and
HiCache's host state store (HostStatePool) written and read back."""
from __future__ import annotations

import pytest
import torch

from kvstrata.config.kv_plan import KVPlan
from kvstrata.config.state_plan import StateComponent
from kvstrata.kv.state_pool import HostStatePool, RecurrentStatePool

CONV = StateComponent("conv", 3, (10, 3), "bfloat16")
SSM = StateComponent("ssm", 3, (2, 4, 5), "float32")


def _pool(slots: int = 6) -> RecurrentStatePool:
    plan = KVPlan(1, 8, 4, 64, "none", (), num_state_slots=slots,
                  state_components=(CONV, SSM))
    pool = RecurrentStatePool(plan, "cpu")
    g = torch.Generator().manual_seed(0)
    for t in pool.tensors.values():
        t.copy_(torch.randn(t.shape, generator=g))
    return pool


def test_shapes_dtypes_and_bytes_follow_the_plan():
    pool = _pool(6)
    assert pool.conv.shape == (3, 7, 10, 3) and pool.conv.dtype == torch.bfloat16
    assert pool.ssm.shape == (3, 7, 2, 4, 5) and pool.ssm.dtype == torch.float32
    assert pool.size_bytes == pool.plan.state_pool_bytes
    fresh = RecurrentStatePool(pool.plan, "cpu")
    assert not fresh.ssm.any() and not fresh.conv.any()  # a zero slot: no token seen


def test_copy_reads_every_source_before_writing():
    pool = _pool()
    before = {n: t.clone() for n, t in pool.tensors.items()}
    pool.copy_slots([2, 3], [3, 5])  # 3 is a source and a destination
    for name, t in pool.tensors.items():
        assert torch.equal(t[:, 3], before[name][:, 2])
        assert torch.equal(t[:, 5], before[name][:, 3])
        assert torch.equal(t[:, [0, 1, 2, 4, 6]], before[name][:, [0, 1, 2, 4, 6]])


def test_zero_and_cpu_copy_restore():
    pool = _pool()
    saved = pool.cpu_copy([1, 4])
    before = {n: t.clone() for n, t in pool.tensors.items()}
    pool.zero_slots([1, 4])
    assert not pool.ssm[:, [1, 4]].any() and not pool.conv[:, [1, 4]].any()
    pool.restore([6, 2], saved)  # back into other slots
    for name, t in pool.tensors.items():
        assert torch.equal(t[:, 6], before[name][:, 1])
        assert torch.equal(t[:, 2], before[name][:, 4])


def test_slots_outside_the_pool_and_mismatched_copies_are_refused():
    pool = _pool(6)
    with pytest.raises(IndexError):
        pool.copy_slots([0], [1])  # the padding sink is no request's
    with pytest.raises(IndexError):
        pool.zero_slots([7])
    with pytest.raises(ValueError):
        pool.copy_slots([1, 2], [3])
    with pytest.raises(ValueError):
        pool.restore([1], pool.cpu_copy([1, 2]))


def test_host_state_store_round_trips_slots():
    """Device slots 2, 4 -> host slots 3, 1; then host 1, 3 -> device 5, 6: the same states,
    every component and layer, in the pool's dtypes; slot ids outside a store are refused."""
    pool = _pool()
    plan = KVPlan(1, 8, 4, 64, "none", (), num_state_slots=6, state_components=(CONV, SSM),
                  num_host_pages=4, host_layout="page_first", io_backend="kernel",
                  num_host_state_slots=3)
    host = HostStatePool(plan, pin_memory=False, check_memory=False)
    assert host.size_bytes == 4 * plan.state_bytes_per_slot
    before = {n: t.clone() for n, t in pool.tensors.items()}
    host.save(pool, [2, 4], [3, 1])
    host.load(pool, [5, 6], [1, 3])
    for name, t in pool.tensors.items():
        assert torch.equal(t[:, 5], before[name][:, 4]) and torch.equal(t[:, 6], before[name][:, 2])
        assert torch.equal(t[:, 1:5], before[name][:, 1:5])  # the sources untouched
        assert host.tensors[name].dtype == t.dtype
    with pytest.raises(IndexError):
        host.save(pool, [1], [4])
    with pytest.raises(ValueError):
        host.load(pool, [1, 2], [1])


def test_host_state_store_larger_than_the_ram_is_refused_before_allocating():
    plan = KVPlan(1, 8, 4, 64, "none", (), num_state_slots=6, state_components=(CONV, SSM),
                  num_host_pages=4, host_layout="page_first", io_backend="kernel",
                  num_host_state_slots=10**12)
    with pytest.raises(ValueError, match="Not enough host memory .* --hicache-mamba-size-gb"):
        HostStatePool(plan)
