"""The StorageBackend contract (kv/storage/base.py), the same tests for every backend: round
trips of random pages at random host page ids between host pools of different layouts (exact
equality), consecutive-hit counting, skip-existing sets, clear, bad batches."""
from __future__ import annotations

import random

import pytest
import torch

from helpers.storage import GEOM, make_backend, make_pool, page_keys, random_flat
from kvstrata.kv.layouts import KVGeometry
from kvstrata.kv.layouts import LAYOUTS
from kvstrata.kv.storage import BACKENDS, StorageConfig, StorageNamespace, create_storage_backend
from kvstrata.kv.storage.staging import FlatPageStaging

READER_LAYOUTS = ("layer_first", "page_head", "page_first_direct", "page_first")


@pytest.fixture(scope="module")
def mooncake_clients(mooncake_master):
    """Mooncake clients by page geometry, shared by this module's tests: closing a client
    takes the Mooncake library ~2 s (holding the GIL), so each test rebinds one to its pools.
    That two separate clients (processes) share pages is test_storage_mooncake.py's job."""
    clients = {}
    yield clients
    for client in clients.values():
        client.close()


@pytest.fixture(params=sorted(BACKENDS))
def backend_factory(request, tmp_path):
    """make(pool) -> a backend of the parametrised kind over `pool`; file and memory make a
    new instance each time (on one directory / one shared store), so a page read by a second
    instance went through the store."""
    name = request.param
    made = []

    def make(pool):
        if name == "mooncake":
            clients = request.getfixturevalue("mooncake_clients")
            geom = pool.geom
            if geom not in clients:
                clients[geom] = make_backend(name, pool, request.getfixturevalue(
                    "mooncake_extra"))
            backend = clients[geom]
            backend.host_pool = pool
        else:
            extra = ({"file_path": str(tmp_path)} if name == "file"
                     else {"memory_store_id": str(tmp_path)})
            backend = make_backend(name, pool, extra)
        made.append(backend)
        return backend
    yield make
    for backend in made:
        backend.clear()
        if name != "mooncake":
            backend.close()


def test_round_trip_across_layouts(backend_factory):
    rng = random.Random(3)
    writer = make_pool("page_first", 24)
    src_ids = rng.sample(range(1, 25), 12)
    flat = random_flat(12, seed=11)
    writer.set_flat_pages(src_ids, flat)
    keys = page_keys(12)
    store = backend_factory(writer)
    assert store.batch_set(keys, src_ids) == [True] * 12
    for layout in READER_LAYOUTS:
        reader = make_pool(layout, 30)
        dst_ids = rng.sample(range(1, 31), 12)
        got = backend_factory(reader).batch_get(keys, dst_ids)
        assert got == [True] * 12, layout
        assert torch.equal(reader.get_flat_pages(dst_ids), flat), layout


def test_bfloat16_pages(backend_factory):
    geom = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=16, page_size=3,
                      dtype=torch.bfloat16)
    writer, reader = make_pool("page_first", 8, geom), make_pool("page_head", 8, geom)
    flat = random_flat(6, seed=5, geom=geom)
    writer.set_flat_pages([3, 1, 8, 2, 7, 5], flat)
    keys = page_keys(6, "bf16")
    assert backend_factory(writer).batch_set(keys, [3, 1, 8, 2, 7, 5]) == [True] * 6
    assert backend_factory(reader).batch_get(keys, [1, 2, 3, 4, 5, 6]) == [True] * 6
    assert torch.equal(reader.get_flat_pages([1, 2, 3, 4, 5, 6]), flat)


def test_mla_pages(backend_factory):
    """An MLA pool (one section: latent + indexer key per token) round-trips like MHA."""
    geom = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=24, page_size=4,
                      dtype=torch.float32, num_sections=1)
    writer, reader = make_pool("page_first", 8, geom), make_pool("layer_first", 8, geom)
    flat = random_flat(5, seed=6, geom=geom)
    writer.set_flat_pages([4, 2, 7, 1, 8], flat)
    keys = page_keys(5, "mla")
    assert backend_factory(writer).batch_set(keys, [4, 2, 7, 1, 8]) == [True] * 5
    assert backend_factory(reader).batch_get(keys, [3, 5, 1, 6, 2]) == [True] * 5
    assert torch.equal(reader.get_flat_pages([3, 5, 1, 6, 2]), flat)


def test_exists_counts_consecutive_hits_and_get_reports_misses(backend_factory):
    pool = make_pool("page_first", 24)
    pool.set_flat_pages(list(range(1, 9)), random_flat(8, seed=2))
    keys = page_keys(8)
    store = backend_factory(pool)
    assert store.batch_exists(keys) == 0 and store.batch_exists([]) == 0
    assert store.batch_set([keys[i] for i in (0, 1, 2, 4, 5)], [1, 2, 3, 5, 6]) == [True] * 5
    assert store.batch_exists(keys) == 3        # keys[3] is missing: stop there
    assert store.batch_exists(keys[4:6]) == 2
    assert store.batch_exists(keys[3:]) == 0
    before, read_before = pool.get_flat_pages([10]), store.stats()["pages_read"]
    assert store.batch_get(keys[2:5], [9, 10, 11]) == [True, False, True]
    assert torch.equal(pool.get_flat_pages([9, 11]), pool.get_flat_pages([3, 5]))
    assert torch.equal(pool.get_flat_pages([10]), before)  # a miss writes nothing there
    assert store.stats()["pages_read"] - read_before == 2


def test_set_skips_stored_keys_and_duplicates(backend_factory):
    pool = make_pool("page_first", 24)
    flat = random_flat(6, seed=9)
    pool.set_flat_pages(list(range(1, 7)), flat)
    keys = page_keys(6)
    store = backend_factory(pool)
    start = store.stats()
    assert store.batch_set(keys[:3], [1, 2, 3]) == [True] * 3
    # keys 0..2 are stored: skipped (True) even though other host pages are offered now
    assert store.batch_set(keys[:4] + [keys[3]], [6, 6, 6, 4, 4]) == [True] * 5
    stats = store.stats()
    assert stats["pages_written"] - start["pages_written"] == 4
    assert stats["pages_skipped"] - start["pages_skipped"] == 4
    assert store.batch_get(keys[:4], [10, 11, 12, 13]) == [True] * 4
    assert torch.equal(pool.get_flat_pages([10, 11, 12, 13]), flat[:4])


def test_clear_and_bad_batches(backend_factory):
    pool = make_pool("page_first", 8)
    pool.set_flat_pages([1, 2], random_flat(2, seed=1))
    store = backend_factory(pool)
    keys = page_keys(2)
    store.batch_set(keys, [1, 2])
    with pytest.raises(ValueError, match="2 keys but 1 host pages"):
        store.batch_get(keys, [1])
    with pytest.raises(ValueError, match="1 keys but 2 host pages"):
        store.batch_set(keys[:1], [1, 2])
    with pytest.raises(ValueError, match="host page ids must be in 1..8"):
        store.batch_set(page_keys(1, "new"), [9])
    store.clear()
    assert store.batch_exists(keys) == 0
    assert store.batch_get(keys, [3, 4]) == [False, False]
    assert store.batch_set(keys, [1, 2]) == [True, True]  # usable after clear
    assert store.batch_exists(keys) == 2


def test_staging_gather_is_get_flat_pages_without_allocating():
    """The writers' one-copy gather (staging.py) against the host pool's own flat order."""
    stage = FlatPageStaging(GEOM.bytes_per_page, 6)
    for layout in LAYOUTS:
        pool = make_pool(layout, 12)
        pool.set_flat_pages(list(range(1, 13)), random_flat(12, seed=8))
        pages = [7, 2, 12, 2, 5]
        rows = stage.gather(pool, pages)
        assert rows.data_ptr() == stage.buffer.data_ptr() and rows.shape == (5, 2880)
        assert torch.equal(rows.view(torch.float32), pool.get_flat_pages(pages)), layout
    with pytest.raises(ValueError, match="7 pages do not fit a 6-page"):
        stage.gather(pool, list(range(1, 8)))
    with pytest.raises(ValueError, match="host page ids must be in 1..12"):
        stage.gather(pool, [0])
    other = make_pool("page_first", 4, KVGeometry(1, 1, 8, 2, torch.float32))
    with pytest.raises(ValueError, match="host pages of 128 bytes"):
        stage.gather(other, [1])


def test_registry_names_the_flag():
    with pytest.raises(ValueError, match="--hicache-storage-backend 'nfs'.*file, memory"):
        create_storage_backend("nfs", None, None)
    assert GEOM.bytes_per_page == 2880


@pytest.mark.parametrize("name", ["memory", "file"])
def test_page_size_mismatch_is_refused(name, tmp_path):
    """Every backend refuses a config whose page size is not the host pool's (base class)."""
    pool = make_pool("page_first", 4)
    config = StorageConfig(StorageNamespace("m", "float32", "g"), GEOM.bytes_per_page + 8,
                           {"file_path": str(tmp_path)})
    with pytest.raises(ValueError, match="storage page_bytes 2888 != host pool page bytes 2880"):
        create_storage_backend(name, config, pool)
