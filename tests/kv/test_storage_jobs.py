"""The storage job runner (transfer/storage_jobs.py) over the in-memory backend and a real host
pool: pages round-trip exactly, every job ends with one final progress, cancels are
synchronous, backend exceptions become errors and never kill a worker."""
from __future__ import annotations

import os
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


def test_swa_halves_are_stored_and_only_the_last_stored_window_is_read(tmp_path):
    """Hybrid SWA memory (cache/swa_storage.py): a second backend over the host SWA pool.
    A backup stores both halves; a prefetch reads every full record and, of the SWA records,
    after each batch (4 pages) only the window before the furthest end whose window is
    wholly stored: pages 1-3 after the first batch, 5-7 after the second and the third (pages
    8 and 9 have no SWA record, so page 8 is the furthest end with a whole window)."""
    from kvstrata.kv.storage.file_store import FileStorage

    full_pool, swa_pool = HostKVPool(GEOM, 24, "page_first"), HostKVPool(GEOM, 24, "layer_first")

    def store(pool, component):
        ns = StorageNamespace("m", "float32", "g", component=component)
        return FileStorage(StorageConfig(ns, GEOM.bytes_per_page, {"file_path": str(tmp_path)}),
                           pool)
    runner = StorageJobRunner(store(full_pool, "full"), batch_pages=4,
                              swa_backend=store(swa_pool, "swa"))
    src = list(range(1, 11))
    for pool in (full_pool, swa_pool):
        pool.set_flat_pages(src, torch.randn(10, GEOM.page_numel))
    swa_keys = [f"swa-{k}" for k in KEYS]
    full_keys = [f"full-{k}" for k in KEYS]
    runner.submit(TransferOp(1, "h2s", [], src[:8], sync=False, keys=full_keys[:8],
                             swa_keys=swa_keys[:8]))
    runner.submit(TransferOp(2, "h2s", [], src[8:], sync=False, keys=full_keys[8:]))  # full only
    assert {p.done_pages for p in finals(runner, [1, 2]).values()} == {8, 2}
    want_full, want_swa = full_pool.get_flat_pages(src), swa_pool.get_flat_pages(src)
    dst = list(range(11, 21))
    runner.submit(TransferOp(3, "s2h", [], dst, sync=False, keys=full_keys, swa_keys=swa_keys,
                             swa_window_pages=3))
    p = finals(runner, [3])[3]
    assert (p.hit_pages, p.done_pages, p.swa_read) == (10, 10, [1, 2, 3, 5, 6, 7])
    assert torch.equal(full_pool.get_flat_pages(dst), want_full)
    assert torch.equal(swa_pool.get_flat_pages(dst[5:8]), want_swa[5:8])
    assert torch.equal(swa_pool.get_flat_pages(dst[1:4]), want_swa[1:4])
    assert os.listdir(tmp_path) and len(os.listdir(tmp_path)) == 2  # one namespace each
    runner.close()


def test_stored_window_end():
    from kvstrata.transfer.storage_jobs import stored_window_end as end

    T, F = True, False
    assert end([T, T, T, F, T, T], 2) == 6 and end([T, T, T, F, T], 2) == 3
    assert end([T], 2) == 1  # the rest of that window lies before the fetch: the tree decides
    assert end([F, T], 2) == 0
    assert end([T, F, F], 2) == 1 and end([F, F], 1) == 0 and end([F, F], 0) == 2
    assert end([], 3) == 0
