"""The `mooncake` storage backend (kv/storage/mooncake_store.py) beyond the shared contract
tests: two servers (processes) on one Mooncake Store, the second reads what the first wrote;
configuration errors fail fast and name the key."""
from __future__ import annotations

import pytest
import torch

from helpers.storage import (make_backend, make_pool, page_keys, random_flat, spawn_child,
                             stop_child, wait_ready)
from kvstrata.kv.storage.mooncake_store import parse_options


def test_second_process_hits_pages_the_first_wrote(mooncake_extra):
    child = spawn_child("writer", backend="mooncake", num_pages=9, seed=21, tag="shared",
                        extra=mooncake_extra, layout="page_first")
    try:
        assert wait_ready(child) == "ready 9"
        pool = make_pool("page_head", 16)  # another layout than the writer's
        store = make_backend("mooncake", pool, mooncake_extra)
        try:
            keys = page_keys(9, "shared")
            assert store.batch_exists(keys + page_keys(1, "absent")) == 9
            dst = [16, 3, 9, 1, 12, 5, 7, 2, 11]
            assert store.batch_get(keys, dst) == [True] * 9
            assert torch.equal(pool.get_flat_pages(dst), random_flat(9, seed=21))
            # what the first server stored is skipped by the second, not written twice
            assert store.batch_set(keys[:4], [1, 2, 3, 4]) == [True] * 4
            assert store.stats()["pages_written"] == 0 and store.stats()["pages_skipped"] == 4
            store.clear()
        finally:
            store.close()
    finally:
        stop_child(child)


def test_config_errors_name_the_key(monkeypatch):
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(ValueError, match="master_server_address"):
        parse_options({})
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1024")
    opts = parse_options({"protocol": "tcp"})
    assert opts["master_server_address"] == "10.0.0.1:50051"
    assert opts["global_segment_size"] == 1024 and opts["metadata_server"] == "P2PHANDSHAKE"
    assert parse_options({"master_server_address": "h:1"})["master_server_address"] == "h:1"
    with pytest.raises(ValueError, match="local_buffer_size='lots'"):
        parse_options({"local_buffer_size": "lots"})
    with pytest.raises(ValueError, match="staging_pages must be positive"):
        parse_options({"staging_pages": 0})


def test_unreachable_master_fails_fast(mooncake_master):
    with pytest.raises(RuntimeError, match="master '127.0.0.1:1' .* not reachable"):
        make_backend("mooncake", make_pool("page_first", 2),
                     {"master_server_address": "127.0.0.1:1"})
