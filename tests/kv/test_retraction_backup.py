"""Decode retraction backups (runner/executors/retraction_backup.py): backup -> garbage over the device
pool -> restore into other pages is bit-exact, for cpu_tensor and for host_pool in every
layout x IO pair the plan allows, page sizes 1 and 16, fp32 and bf16.

Odd geometry (3 layers, 2 heads, head dim 12) so a swapped axis cannot hide; random bits,
not randn, so NaN payloads and -0.0 must survive too; page ids unsorted and non-contiguous,
restored into pages that overlap other requests' old ones.
"""
from __future__ import annotations

import pytest
import torch

from kvstrata.config.kv_plan import IO_BACKEND_LAYOUTS, KVPlan, check_host_layout_io
from kvstrata.kv.device_pool import MHATokenToKVPool
from kvstrata.kv.host_pool import HostKVPool
from kvstrata.kv.io_backends import make_io_backend
from kvstrata.protocol.disagg import BackupOp
from kvstrata.runner.executors.retraction_backup import RetractionBackupExecutor, with_swa_pool

L, H, D = 3, 2, 12
DEVICE_PAGES, HOST_PAGES = 20, 16
PAIRS = [(io, layout) for io, layouts in IO_BACKEND_LAYOUTS.items() for layout in layouts]
# ("cpu_tensor", "torch", None): the torch index path a device pool on a GPU takes, run on CPU.
BACKENDS = [("cpu_tensor", None, None), ("cpu_tensor", "torch", None)] + [
    ("host_pool", io, layout) for io, layout in PAIRS]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# rid -> (pages backed up, host pages, unused tokens of the last page, pages restored into).
# Restores land on pages other requests held before (the scheduler reuses freed pages at
# once).
REQS = {
    "a": ([7, 2, 15, 9], [5, 12, 3, 9], 3, [15, 1, 20, 4]),
    "b": ([11, 3], [1, 2], 0, [7, 9]),
    "c": ([18], [16], 15, [3]),
}


def _random_bits(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.itemsize == 2:
        return torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int16).view(dtype)
    return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int32).view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _setup(backend, io, layout, page_size, dtype):
    plan = KVPlan.mha(num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype,
                      page_size=page_size, num_pages=DEVICE_PAGES)
    pool = MHATokenToKVPool(plan, "cpu")
    pool.kv.copy_(_random_bits(pool.kv.shape, pool.kv.dtype, seed=1))
    if backend == "cpu_tensor":
        ex = RetractionBackupExecutor(pool)
        ex._native = io != "torch"
        return pool, ex
    check_host_layout_io(layout, io)
    host = HostKVPool(pool.geom, HOST_PAGES, layout)
    kwargs = {"staging_bytes": 1024} if io == "kernel" else {}
    return pool, RetractionBackupExecutor(pool, host, make_io_backend(io, pool.kv, host,
                                                                      **kwargs))


def _pages(pool, ids) -> torch.Tensor:
    P = pool.plan.page_size
    return _bits(pool.kv.view(2, L, DEVICE_PAGES + 1, P, H, D)[:, :, ids]).clone()


def _op(kind, rid, backend, which=0, page_size=4):
    pages, host, unused, new = REQS[rid]
    tokens = len(pages) * page_size - min(unused, page_size - 1)
    return BackupOp(kind, rid, backend, tokens, pages if which == 0 else new,
                    host if backend == "host_pool" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend,io,layout", BACKENDS)
def test_backup_garbage_restore_round_trip(backend, io, layout, page_size, dtype):
    pool, ex = _setup(backend, io, layout, page_size, dtype)
    want = {rid: _pages(pool, pages) for rid, (pages, *_rest) in REQS.items()}
    # Interleaved: a and b backed up in one step, a restored before c is even backed up.
    P = page_size
    ex.apply([_op("backup", "a", backend, 0, P), _op("backup", "b", backend, 0, P)])
    pool.kv.copy_(_random_bits(pool.kv.shape, pool.kv.dtype, seed=2))  # pages reused
    ex.apply([_op("restore", "a", backend, 1, P)])
    assert torch.equal(_pages(pool, REQS["a"][3]), want["a"])
    want["c"] = _pages(pool, REQS["c"][0])
    ex.apply([_op("backup", "c", backend, 0, P)])
    pool.kv.copy_(_random_bits(pool.kv.shape, pool.kv.dtype, seed=3))
    ex.apply([_op("restore", "c", backend, 1, P), _op("restore", "b", backend, 1, P)])
    for rid in ("b", "c"):
        assert torch.equal(_pages(pool, REQS[rid][3]), want[rid]), rid
    assert ex.num_backups == 0
    s = ex.stats()
    page_bytes = pool.geom.bytes_per_page
    assert s[f"{backend}_backup_count"] == 3 and s[f"{backend}_restore_count"] == 3
    assert s["backup_bytes"] == s["restore_bytes"] == 7 * page_bytes
    assert s["restore_seconds"] > 0 and s["held_backups"] == 0


def test_cpu_backup_is_a_copy_not_a_view():
    pool, ex = _setup("cpu_tensor", None, None, 4, "float32")
    want = _pages(pool, [5, 6])
    ex.apply([BackupOp("backup", "r", "cpu_tensor", 8, [5, 6])])
    pool.kv.fill_(float("nan"))  # the source pages too
    ex.apply([BackupOp("restore", "r", "cpu_tensor", 8, [5, 6])])  # back into the same pages
    assert torch.equal(_pages(pool, [5, 6]), want)
    assert ex.stats()["held_cpu_tensor_bytes"] == 0


@pytest.mark.parametrize("backend", ["cpu_tensor", "host_pool"])
def test_discard_is_idempotent(backend):
    pool, ex = _setup(backend, "kernel", "page_first", 4, "float32")
    ex.apply([_op("backup", "a", backend), _op("backup", "b", backend)])
    assert ex.has_backup("a") and ex.stats()["held_backups"] == 2
    discard = BackupOp("discard", "a", backend)
    ex.apply([discard, discard, BackupOp("discard", "never-seen", backend)])
    assert not ex.has_backup("a") and ex.has_backup("b")
    assert ex.stats()["discard_count"] == 1
    with pytest.raises(ValueError, match="no .* backup held"):
        ex.apply([_op("restore", "a", backend, 1)])
    ex.apply([_op("restore", "b", backend, 1), BackupOp("discard", "b", backend)])
    assert ex.num_backups == 0
    ex.apply([_op("backup", "a", backend)])  # the rid may be backed up again
    ex.close()
    assert ex.num_backups == 0


def test_bad_ops_are_refused():
    pool, ex = _setup("cpu_tensor", None, None, 4, "float32")
    ex.apply([BackupOp("backup", "r", "cpu_tensor", 8, [5, 6])])
    with pytest.raises(ValueError, match="already has a KV backup"):
        ex.apply([BackupOp("backup", "r", "cpu_tensor", 8, [7, 8])])
    with pytest.raises(ValueError, match="3 device pages for a backup of 2"):
        ex.apply([BackupOp("restore", "r", "cpu_tensor", 8, [1, 2, 3])])
    with pytest.raises(ValueError, match="device page ids"):
        ex.apply([BackupOp("backup", "s", "cpu_tensor", 4, [DEVICE_PAGES + 1])])
    with pytest.raises(ValueError, match="do not fit"):
        ex.apply([BackupOp("backup", "s", "cpu_tensor", 9, [3, 4])])
    with pytest.raises(ValueError, match="no retraction host pool"):
        ex.apply([BackupOp("backup", "h", "host_pool", 4, [3], [1])])
    with pytest.raises(ValueError, match="unknown backend"):
        ex.apply([BackupOp("backup", "h", "disk", 4, [3])])
    # An empty backup (seq_len <= 1: nothing to keep) round trips too.
    ex.apply([BackupOp("backup", "e", "cpu_tensor", 0, []),
              BackupOp("restore", "e", "cpu_tensor", 0, [])])
    _, hx = _setup("host_pool", "direct", "layer_first", 4, "float32")
    hx.apply([BackupOp("backup", "h", "host_pool", 4, [3], [1])])
    with pytest.raises(ValueError, match="differ from the backup"):
        hx.apply([BackupOp("restore", "h", "host_pool", 4, [5], [2])])


@pytest.mark.parametrize("backend", ["cpu_tensor", "host_pool"])
def test_swa_window_pages_round_trip_beside_the_full_pages(backend):
    """Hybrid SWA memory (with_swa_pool): the live window's SWA pages (the last of the op's
    pages) go with the full pages -- host_pool into the host pool's SWA half under the host
    ids of their full pages -- and come back bit-exact into other SWA pages."""
    pool, ex = _setup(backend, "kernel", "page_first", 4, "float32")
    swa_plan = KVPlan.mha(num_layers=2, num_kv_heads=H, head_dim=D, dtype="float32",
                          page_size=4, num_pages=8)
    swa = MHATokenToKVPool(swa_plan, "cpu")
    swa.kv.copy_(_random_bits(swa.kv.shape, swa.kv.dtype, seed=4))
    with_swa_pool(ex, swa, HostKVPool(swa.geom, HOST_PAGES, "page_first")
                  if backend == "host_pool" else None, "kernel")

    def window(ids):
        return _bits(swa.kv.view(2, 2, 9, 4, H, D)[:, :, ids]).clone()

    want_full, want_swa = _pages(pool, REQS["a"][0]), window([6, 2])
    op = _op("backup", "a", backend)
    ex.apply([BackupOp(op.kind, op.rid, backend, op.num_tokens, op.device_pages,
                       op.host_pages, swa_pages=[6, 2])])
    pool.kv.copy_(_random_bits(pool.kv.shape, pool.kv.dtype, seed=5))
    swa.kv.copy_(_random_bits(swa.kv.shape, swa.kv.dtype, seed=6))
    op = _op("restore", "a", backend, 1)
    ex.apply([BackupOp(op.kind, op.rid, backend, op.num_tokens, op.device_pages,
                       op.host_pages, swa_pages=[3, 8])])
    assert torch.equal(_pages(pool, REQS["a"][3]), want_full)
    assert torch.equal(window([3, 8]), want_swa)
    assert ex.num_backups == 0 and ex.swa.num_backups == 0
    assert ex.swa.stats()[f"{backend}_restore_count"] == 1


@pytest.mark.parametrize("backend", ["cpu_tensor", "host_pool"])
def test_discard_drops_the_swa_window_backup_too(backend):
    """A discard ends both halves of a hybrid-SWA backup: the full pages' and the window's."""
    pool, ex = _setup(backend, "kernel", "page_first", 4, "float32")
    swa = MHATokenToKVPool(KVPlan.mha(num_layers=2, num_kv_heads=H, head_dim=D,
                                      dtype="float32", page_size=4, num_pages=8), "cpu")
    with_swa_pool(ex, swa, HostKVPool(swa.geom, HOST_PAGES, "page_first")
                  if backend == "host_pool" else None, "kernel")
    op = _op("backup", "a", backend)
    ex.apply([BackupOp(op.kind, op.rid, backend, op.num_tokens, op.device_pages,
                       op.host_pages, swa_pages=[6, 2])])
    assert ex.num_backups == 1 and ex.swa.num_backups == 1
    ex.apply([BackupOp("discard", "a", backend)])
    assert ex.num_backups == 0 and ex.swa.num_backups == 0
    assert ex.stats()["discard_count"] == 1 and ex.swa.stats()["discard_count"] == 1
