"""The storage job runner (transfer/storage_jobs.py) over the in-memory backend and a real host
pool: pages round-trip exactly, every job ends with one final progress, cancels are
synchronous, backend exceptions become errors and never kill a worker."""
from __future__ import annotations

import threading

import torch

from kvstrata.kv.host_pool import HostKVPool
from kvstrata.kv.layouts import KVGeometry
from kvstrata.kv.storage import StorageConfig, StorageNamespace
from kvstrata.kv.storage.memory import MemoryStorage
from kvstrata.protocol import TransferOp
from kvstrata.transfer.storage_jobs import StorageJobRunner

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
KEYS = [f"{i:064x}" for i in range(1, 11)]


def make(backend_cls=MemoryStorage, batch_pages=4):
    pool = HostKVPool(GEOM, 24, "page_first")
    config = StorageConfig(StorageNamespace("m", "float32", "g"), GEOM.bytes_per_page)
    return pool, StorageJobRunner(backend_cls(config, pool), batch_pages=batch_pages)


def finals(runner, job_ids, timeout=10.0):
    """Collect progress until each job id has its final entry; returns {id: final}."""
    done = {}
    for _ in range(200):
        for p in runner.wait_any(timeout / 200):
            if p.finished:
                assert p.job_id not in done, "two final progress entries"
                done[p.job_id] = p
        if set(job_ids) <= set(done):
            return done
    raise AssertionError(f"jobs {set(job_ids) - set(done)} never finished")


def test_backup_then_prefetch_round_trips_pages():
    pool, runner = make()
    src = list(range(1, 11))
    pool.set_flat_pages(src, torch.randn(10, GEOM.page_numel))
    want = pool.get_flat_pages(src)
    runner.submit(TransferOp(1, "h2s", [], src, sync=False, keys=KEYS))
    assert finals(runner, [1])[1].done_pages == 10
    dst = list(range(11, 21))
    runner.submit(TransferOp(2, "s2h", [], dst, sync=False, keys=KEYS[:7] + ["f" * 64] * 3))
    p = finals(runner, [2])[2]
    assert (p.hit_pages, p.done_pages, p.error) == (7, 7, "")
    assert torch.equal(pool.get_flat_pages(dst[:7]), want[:7])
    runner.close()


class SlowStorage(MemoryStorage):
    """batch_get blocks until released: a prefetch stays mid-job."""
    gate = threading.Event()
    reading = threading.Event()  # set once a batch_get is under way

    def batch_exists(self, keys):
        return len(keys)

    def batch_get(self, keys, host_pages):
        self.reading.set()
        self.gate.wait(10)
        return [True] * len(keys)


def test_cancel_is_synchronous_and_stops_between_batches():
    pool, runner = make(SlowStorage, batch_pages=2)
    runner.submit(TransferOp(1, "s2h", [], [1, 2, 3, 4, 5, 6], sync=False, keys=KEYS[:6]))
    runner.submit(TransferOp(2, "s2h", [], [7, 8], sync=False, keys=KEYS[6:8]))  # queued
    runner.cancel(2)  # never started: ends at once
    assert {p.job_id: p.finished for p in runner.poll()}.get(2) is True
    # Cancel only once job 1 is inside its first batch (a busy box may start it late).
    assert SlowStorage.reading.wait(10), "the prefetch never started reading"
    threading.Timer(0.2, SlowStorage.gate.set).start()
    runner.cancel(1)  # returns after the batch being read
    final = [p for p in runner.poll() if p.job_id == 1 and p.finished]
    assert final and final[0].done_pages == 2 and not runner.busy()
    runner.close()


class BrokenStorage(MemoryStorage):
    def batch_set(self, keys, host_pages):
        raise OSError("disk gone")


def test_backend_exception_is_an_error_and_the_worker_survives():
    pool, runner = make(BrokenStorage)
    runner.submit(TransferOp(1, "h2s", [], [1, 2], sync=False, keys=KEYS[:2]))
    runner.submit(TransferOp(2, "h2s", [], [3], sync=False, keys=KEYS[2:3]))
    got = finals(runner, [1, 2])
    assert all("OSError: disk gone" in p.error and p.done_pages == 0 for p in got.values())
    runner.close()
