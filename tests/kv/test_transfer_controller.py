"""Transfer controller: jobs run off the caller's thread and come back as finished/failed ids."""
from __future__ import annotations

import threading

import pytest
import torch

from kvstrata.kv.host_pool import HostKVPool
from kvstrata.kv.io_backends import make_io_backend
from kvstrata.kv.layouts import KVGeometry
from kvstrata.transfer import TransferController


def _backend():
    geom = KVGeometry(2, 2, 8, 4, torch.float32)
    device_kv = torch.randn(2, 2, 11 * 4, 2, 8)
    return make_io_backend("kernel", device_kv, HostKVPool(geom, 12, "page_first"))


def test_write_then_load_round_trip():
    io = _backend()
    original = io.device_kv.clone()
    with TransferController(io) as ctl:
        w = ctl.submit("write", [3, 1, 2], [5, 6, 9])
        finished, failed = ctl.drain(timeout=30)
        assert (finished, failed) == ([w], [])
        io.device_kv.zero_()
        load = ctl.submit("load", [7, 8, 4], [5, 6, 9])
        assert ctl.drain(timeout=30) == ([load], [])
        assert ctl.poll_finished() == ([], [])  # each id is reported once
    pages = original.view(2, 2, -1, 4, 2, 8)
    got = io.device_kv.view(2, 2, -1, 4, 2, 8)
    assert torch.equal(got[:, :, [7, 8, 4]], pages[:, :, [3, 1, 2]])
    assert ctl.stats["write_bytes"] == 3 * io.host_pool.geom.bytes_per_page


def test_an_swa_only_load_moves_the_swa_halves_and_leaves_the_full_pages():
    """Hybrid SWA memory: a load with `swa_only` (a device tombstone's window coming back,
    cache/swa_hiradix.py `_revive`) copies each host page's SWA half into its SWA page; the
    full device pages it names are left as they are, even where the host copy differs."""
    io, swa_io = _backend(), _backend()
    with TransferController(io, swa_io=swa_io) as ctl:
        ctl.submit("write", [3, 1], [5, 6], swa_pages=[2, 4])
        assert ctl.drain(timeout=30)[1] == []
        written = swa_io.device_kv.view(2, 2, -1, 4, 2, 8)[:, :, [2, 4]].clone()
        io.device_kv.view(2, 2, -1, 4, 2, 8)[:, :, [3, 1]] += 1.0  # host copy now differs
        full, _ = io.device_kv.clone(), swa_io.device_kv.zero_()
        load = ctl.submit("load", [3, 1], [5, 6], swa_pages=[7, 9], swa_only=True)
        assert ctl.drain(timeout=30) == ([load], [])
        with pytest.raises(ValueError, match="swa_only"):
            ctl.submit("load", [3], [5], swa_only=True)
    assert torch.equal(io.device_kv, full)
    assert torch.equal(swa_io.device_kv.view(2, 2, -1, 4, 2, 8)[:, :, [7, 9]], written)


def test_failing_job_is_reported_and_the_worker_survives():
    io = _backend()
    with TransferController(io) as ctl:
        bad = ctl.submit("write", [1, 2], [0, 3])      # host page 0 is reserved: raises
        good = ctl.submit("load", [4], [3])
        finished, failed = ctl.drain(timeout=30)
        assert failed == [bad] and finished == [good]
        assert "host page ids" in ctl.error(bad)
        assert ctl.error(good) is None


def test_jobs_run_on_a_worker_thread_in_order():
    io = _backend()
    seen = []
    original = io.write_back

    def spy(device_pages, host_pages):
        seen.append((threading.current_thread().name, device_pages.tolist()))
        original(device_pages, host_pages)

    io.write_back = spy
    with TransferController(io, name="xfer-test") as ctl:
        ids = [ctl.submit("write", [p], [p]) for p in (1, 2, 3)]
        finished, failed = ctl.drain(timeout=30)
    assert sorted(finished) == ids and failed == []
    assert seen == [("xfer-test", [1]), ("xfer-test", [2]), ("xfer-test", [3])]


def test_submit_validates_arguments_and_close():
    ctl = TransferController(_backend())
    with pytest.raises(ValueError, match="transfer kind"):
        ctl.submit("evict", [1], [1])
    with pytest.raises(ValueError, match="1 device pages but 2 host pages"):
        ctl.submit("write", [1], [1, 2])
    ctl.close()
    with pytest.raises(RuntimeError, match="closed"):
        ctl.submit("write", [1], [1])


def test_wait_any_blocks_on_a_copy_instead_of_spinning():
    """An engine step with nothing to compute but a copy in flight waits in wait_any: it
    returns when the copy finishes (not before, not much later), and at once when nothing
    is outstanding; a copy longer than the timeout returns empty after the timeout."""
    import time

    io = _backend()
    release = threading.Event()
    original = io.write_back

    def slow(device_pages, host_pages):
        release.wait(10)
        original(device_pages, host_pages)

    io.write_back = slow
    with TransferController(io) as ctl:
        start = time.monotonic()
        assert ctl.wait_any(timeout=0) == ([], [])  # nothing outstanding
        job = ctl.submit("write", [1], [1])
        assert ctl.wait_any(timeout=0.2) == ([], [])  # still copying
        assert time.monotonic() - start >= 0.2
        threading.Timer(0.2, release.set).start()
        t0 = time.monotonic()
        assert ctl.wait_any(timeout=10) == ([job], [])
        assert 0.15 <= time.monotonic() - t0 < 5
        assert ctl.wait_any(timeout=10) == ([], [])  # reported once; returns at once
