"""HiCache L3 of recurrent state, the byte-moving half: the host state slots as a storage
backend sees them (HostStatePool's flat slot records), and the storage job runner's state
jobs (transfer/storage_jobs.py) over the file store: a state backup, then a prefetch that
reads the furthest stored state among its hit pages and cuts the hit there, from a second
backend instance on the same directory (a restart); and with no page backend (a model
without K/V, Mamba2), state records alone."""
from __future__ import annotations

import pytest
import torch

from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv.host_pool import HostKVPool
from kvstrata.kv.layouts import KVGeometry
from kvstrata.kv.state_pool import HostStatePool
from kvstrata.kv.storage import StorageConfig, StorageNamespace
from kvstrata.kv.storage.file_store import FileStorage
from kvstrata.protocol import TransferOp
from kvstrata.transfer.storage_jobs import StorageJobRunner
from tests.kv.test_state_pool import CONV, SSM, _pool
from tests.kv.test_storage_jobs import finals

PLAN = KVPlan(1, 8, 4, 64, "none", (), num_state_slots=6, state_components=(CONV, SSM),
              num_host_pages=8, host_layout="page_first", io_backend="kernel",
              num_host_state_slots=4)
GEOM = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, page_size=1, dtype=torch.float32)
KEYS = [f"{i:064x}" for i in range(1, 7)]


def test_flat_slot_records_round_trip_through_the_components():
    """A slot's record is every component of every layer; writing it into another slot and
    loading that to the device gives the same state (bf16 conv and fp32 ssm alike)."""
    pool = _pool()
    host = HostStatePool(PLAN, pin_memory=False, check_memory=False)
    assert host.slot_bytes == PLAN.state_bytes_per_slot == host.geom.bytes_per_page
    host.save(pool, [2], [1])
    host.set_flat_pages([3], host.get_flat_pages([1]))
    host.load(pool, [5], [3])
    for name, t in pool.tensors.items():
        assert torch.equal(t[:, 5], t[:, 2]), name
    assert torch.equal(host.device_order()[0, 0, 3, 0, 0], host.records[3])


def runners(tmp_path):
    """A page store and a state store over one directory, as the HiCache executor opens them."""
    pages = HostKVPool(GEOM, 8, "page_first")
    states = HostStatePool(PLAN, pin_memory=False, check_memory=False)
    page_ns = StorageNamespace("m", "float32", "g")
    state_ns = StorageNamespace.for_states(PLAN, "m")
    extra = {"file_path": str(tmp_path)}
    return pages, states, StorageJobRunner(
        FileStorage(StorageConfig(page_ns, GEOM.bytes_per_page, extra), pages),
        state_backend=FileStorage(StorageConfig(state_ns, states.slot_bytes, extra), states))


def test_a_prefetch_reads_the_furthest_stored_state_and_cuts_the_hit_there(tmp_path):
    pool = _pool()
    pages, states, runner = runners(tmp_path)
    pages.set_flat_pages(list(range(1, 7)), torch.randn(6, GEOM.page_numel))
    runner.submit(TransferOp(1, "h2s", [], list(range(1, 7)), sync=False, keys=KEYS))
    states.save(pool, [2, 4], [1, 2])  # the states after pages 2 and 4
    state_keys = [f"state-{k}" for k in KEYS]
    runner.submit(TransferOp(2, "h2s", [], [], sync=False, state_keys=[state_keys[1],
                                                                          state_keys[3]],
                             host_state_slots=[1, 2]))
    done = finals(runner, [1, 2])
    assert (done[1].done_pages, done[2].hit_pages, done[2].done_pages) == (6, 2, 2)
    runner.close()

    pool.zero_slots([5])
    pages, states, runner = runners(tmp_path)  # a restart: new pools and backends
    runner.submit(TransferOp(3, "s2h", [], [1, 2, 3, 4, 5, 6], sync=False, keys=KEYS,
                             state_keys=state_keys, host_state_slots=[3]))
    p = finals(runner, [3])[3]
    assert (p.hit_pages, p.done_pages, p.state_page, p.error) == (4, 4, 4, "")
    states.load(pool, [5], [3])
    for t in pool.tensors.values():
        assert torch.equal(t[:, 5], t[:, 4])
    # only pages 0..2 stored under these keys: the state after page 2 is the furthest
    runner.submit(TransferOp(4, "s2h", [], [1, 2, 3], sync=False,
                             keys=KEYS[:3], state_keys=state_keys[:3], host_state_slots=[4]))
    p = finals(runner, [4])[4]
    assert (p.hit_pages, p.state_page) == (2, 2)
    # no state among the hit pages: nothing is read
    runner.submit(TransferOp(5, "s2h", [], [1], sync=False, keys=KEYS[:1],
                             state_keys=state_keys[:1], host_state_slots=[4]))
    p = finals(runner, [5])[5]
    assert (p.hit_pages, p.done_pages, p.state_page) == (0, 0, 0)
    assert runner.state_backend.stats()["pages_read"] == 2
    runner.close()


def test_pages_without_kv_store_state_records_alone(tmp_path):
    """A model without K/V (Mamba2): no page backend. A page backup is done at once and
    stores nothing; a prefetch takes every page as present and cuts at the furthest stored
    state (its key chains over the whole prefix), reading no page; a prefetch without state
    keys is refused (nothing would say how far the prefix is stored)."""
    pool = _pool()
    states = HostStatePool(PLAN, pin_memory=False, check_memory=False)
    state_ns = StorageNamespace.for_states(PLAN, "m")

    def runner():
        return StorageJobRunner(None, state_backend=FileStorage(StorageConfig(
            state_ns, states.slot_bytes, {"file_path": str(tmp_path)}), states))

    jobs = runner()
    jobs.submit(TransferOp(1, "h2s", [], list(range(1, 7)), sync=False, keys=KEYS))
    states.save(pool, [3], [1])  # the state after page 3
    state_keys = [f"state-{k}" for k in KEYS]
    jobs.submit(TransferOp(2, "h2s", [], [], sync=False, state_keys=[state_keys[2]],
                           host_state_slots=[1]))
    done = finals(jobs, [1, 2])
    assert (done[1].hit_pages, done[1].done_pages, done[2].done_pages) == (6, 6, 1)
    jobs.close()
    assert len(list(tmp_path.iterdir())) == 1  # the state namespace only

    jobs = runner()  # a restart
    jobs.submit(TransferOp(3, "s2h", [], list(range(1, 7)), sync=False, keys=KEYS,
                           state_keys=state_keys, host_state_slots=[2]))
    p = finals(jobs, [3])[3]
    assert (p.hit_pages, p.done_pages, p.state_page, p.error) == (3, 3, 3, "")
    pool.zero_slots([5])
    states.load(pool, [5], [2])
    for t in pool.tensors.values():
        assert torch.equal(t[:, 5], t[:, 3])
    jobs.submit(TransferOp(4, "s2h", [], [1, 2], sync=False, keys=KEYS[:2],
                           state_keys=state_keys[:2], host_state_slots=[2]))
    p = finals(jobs, [4])[4]  # no state stored among them: nothing is known
    assert (p.hit_pages, p.done_pages, p.state_page) == (0, 0, 0)
    with pytest.raises(ValueError, match="needs state keys"):
        jobs.submit(TransferOp(5, "s2h", [], [1], sync=False, keys=KEYS[:1]))
    jobs.close()
