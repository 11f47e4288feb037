"""The `file` storage backend (kv/storage/file_store.py): restart, index loss and staleness,
corruption and truncation are misses (never wrong data), torn tails, LRU eviction of whole
segments, bad config, and two processes on one directory."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from helpers.storage import (NAMESPACE, make_backend, make_pool, page_keys, random_flat,
                             spawn_child, stop_child, wait_ready)
from kvstrata.kv.storage import file_store
from kvstrata.kv.storage.file_index import INDEX_FILE
from kvstrata.kv.storage.file_records import HEADER, payload_sums

RECORD = HEADER.size + 64 + 2880  # header + 64-hex key + flat page of helpers.storage.GEOM


@pytest.fixture
def pool():
    p = make_pool("page_first", 40)
    p.set_flat_pages(list(range(1, 41)), random_flat(40, seed=1))
    return p


def open_store(pool, path, **extra):
    return make_backend("file", pool, {"file_path": str(path), **extra})


def ns_dir(path) -> str:
    return os.path.join(str(path), NAMESPACE.name)


def segments(path) -> list[str]:
    return sorted(n for n in os.listdir(ns_dir(path)) if n.endswith(".seg"))


def assert_pages(store, pool, keys, src_ids):
    """All `keys` hit, and read back exactly the pages `src_ids` of `pool`."""
    dst = list(range(21, 21 + len(keys)))
    assert store.batch_get(keys, dst) == [True] * len(keys)
    assert torch.equal(pool.get_flat_pages(dst), pool.get_flat_pages(src_ids))


def test_payload_sums_match_python_integers_and_catch_moved_words():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (3, 8 * 50 + 5), dtype=torch.uint8, generator=gen)
    rows[0, :16] = 255  # words near 2**64: the sums must wrap, not saturate
    for row, (s1, s2) in zip(rows, payload_sums(rows)):
        raw = bytes(row.tolist()) + bytes(3)  # zero-padded to whole words
        words = [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]
        assert s1 == sum(words) % 2**64
        assert s2 == sum((i + 1) * w for i, w in enumerate(words)) % 2**64
    swapped = rows.clone()
    swapped[1, 0:8], swapped[1, 8:16] = rows[1, 8:16], rows[1, 0:8]
    flipped = rows.clone()
    flipped[2, 200] ^= 1
    sums, changed = payload_sums(rows), payload_sums(swapped) + payload_sums(flipped)
    assert sums[0] == changed[0] and sums[1] != changed[1]  # same S1, different S2
    assert sums[2] != changed[5] and sums[1][0] == changed[1][0]


def test_restart_finds_everything_and_rebuilds_a_lost_index(pool, tmp_path):
    keys = page_keys(10)
    store = open_store(pool, tmp_path, segment_bytes=4 * RECORD)
    assert store.batch_set(keys, list(range(1, 11))) == [True] * 10
    store.close()
    assert len(segments(tmp_path)) == 3 and os.path.exists(os.path.join(ns_dir(tmp_path),
                                                                         INDEX_FILE))
    again = open_store(pool, tmp_path)
    assert again.stats()["index_loaded"] and again.stats()["segments_scanned"] == 0
    assert again.batch_exists(keys) == 10
    assert_pages(again, pool, keys, list(range(1, 11)))
    again.close()
    os.unlink(os.path.join(ns_dir(tmp_path), INDEX_FILE))
    rebuilt = open_store(pool, tmp_path)
    stats = rebuilt.stats()
    assert not stats["index_loaded"] and stats["segments_scanned"] == 3
    assert stats["pages_stored"] == 10 and rebuilt.batch_exists(keys) == 10
    assert_pages(rebuilt, pool, keys, list(range(1, 11)))


def test_stale_or_garbage_index_is_completed_from_the_segments(pool, tmp_path):
    keys = page_keys(8)
    first = open_store(pool, tmp_path)
    first.batch_set(keys[:4], [1, 2, 3, 4])
    first.flush_index()
    first.batch_set(keys[4:], [5, 6, 7, 8])  # written after the index was saved; never closed
    second = open_store(pool, tmp_path)  # its segment grew past what the index covers
    assert second.stats()["index_loaded"] and second.batch_exists(keys) == 8
    assert_pages(second, pool, keys, list(range(1, 9)))
    with open(os.path.join(ns_dir(tmp_path), INDEX_FILE), "w") as f:
        f.write('{"version": 1, "segm')
    third = open_store(pool, tmp_path)
    assert not third.stats()["index_loaded"] and third.batch_exists(keys) == 8


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_flipped_payload_byte_is_a_miss_and_can_be_rewritten(pool, tmp_path):
    keys = page_keys(6)
    store = open_store(pool, tmp_path)
    store.batch_set(keys, [1, 2, 3, 4, 5, 6])
    seg = os.path.join(ns_dir(tmp_path), segments(tmp_path)[0])
    _flip(seg, 2 * RECORD + HEADER.size + 64 + 1000)  # inside keys[2]'s payload
    before = pool.get_flat_pages([23])
    assert store.batch_get(keys, list(range(21, 27))) == [True, True, False, True, True, True]
    assert torch.equal(pool.get_flat_pages([23]), before)  # no wrong data landed
    assert torch.equal(pool.get_flat_pages([21, 22, 24, 25, 26]),
                       pool.get_flat_pages([1, 2, 4, 5, 6]))
    assert store.stats()["corrupt_records"] == 1
    assert store.batch_exists(keys) == 2  # the bad record left the index
    assert store.batch_set(keys, [1, 2, 3, 4, 5, 6]) == [True] * 6  # rewrites keys[2] only
    assert store.stats()["pages_written"] == 7
    assert_pages(store, pool, keys, [1, 2, 3, 4, 5, 6])
    store.check_integrity()


def test_flipped_header_byte_stops_the_scan_there(pool, tmp_path):
    keys = page_keys(5)
    store = open_store(pool, tmp_path)
    store.batch_set(keys, [1, 2, 3, 4, 5])
    store.close()
    seg = os.path.join(ns_dir(tmp_path), segments(tmp_path)[0])
    _flip(seg, 3 * RECORD + HEADER.size + 5)  # keys[3]'s key bytes
    os.unlink(os.path.join(ns_dir(tmp_path), INDEX_FILE))
    again = open_store(pool, tmp_path)
    # records after a bad header cannot be located safely: misses, never data
    assert again.batch_exists(keys) == 3
    assert again.batch_get(keys, [21, 22, 23, 24, 25]) == [True, True, True, False, False]


def test_truncated_segment_records_miss_live_and_after_restart(pool, tmp_path):
    keys = page_keys(6)
    store = open_store(pool, tmp_path)
    store.batch_set(keys, [1, 2, 3, 4, 5, 6])
    store.flush_index()
    seg = os.path.join(ns_dir(tmp_path), segments(tmp_path)[0])
    os.truncate(seg, 3 * RECORD + 100)  # keys[3] loses most of its payload, 4 and 5 are gone
    assert store.batch_get(keys, list(range(21, 27))) == [True] * 3 + [False] * 3
    assert torch.equal(pool.get_flat_pages([21, 22, 23]), pool.get_flat_pages([1, 2, 3]))
    restarted = open_store(pool, tmp_path)  # the index says 6 records: it rescans the segment
    assert restarted.batch_exists(keys) == 3 and restarted.stats()["pages_stored"] == 3


def test_torn_tail_is_ignored_and_writing_goes_on(pool, tmp_path):
    keys = page_keys(8)
    store = open_store(pool, tmp_path)
    store.batch_set(keys[:4], [1, 2, 3, 4])
    seg = os.path.join(ns_dir(tmp_path), segments(tmp_path)[0])
    with open(seg, "rb") as f:
        whole = f.read(RECORD)
    with open(seg, "ab") as f:  # a writer that died mid-record
        f.write(whole[:HEADER.size + 64 + 700])
    del store  # no close, no index: like a crash
    again = open_store(pool, tmp_path)
    assert again.batch_exists(keys) == 4
    assert again.batch_set(keys, list(range(1, 9))) == [True] * 8
    assert len(segments(tmp_path)) == 2  # never appends after someone's torn tail
    again.close()
    assert_pages(open_store(pool, tmp_path), pool, keys, list(range(1, 9)))


def test_lru_eviction_deletes_whole_least_recently_used_segments(pool, tmp_path):
    keys = page_keys(16)
    store = open_store(pool, tmp_path, segment_bytes=4 * RECORD, max_bytes=12 * RECORD)
    for start in (0, 4, 8):  # three full segments: A, B, C
        assert store.batch_set(keys[start:start + 4], list(range(start + 1, start + 5))) \
            == [True] * 4
    seg_a, seg_b, seg_c = segments(tmp_path)
    assert store.batch_get(keys[:1], [30]) == [True]  # A is now more recent than B
    assert store.batch_set(keys[12:16], list(range(13, 17))) == [True] * 4  # needs room
    stats = store.stats()
    assert stats["evicted_segments"] == 1 and stats["evicted_pages"] == 4
    assert stats["evicted_bytes"] == 4 * RECORD and stats["bytes_stored"] <= 12 * RECORD
    assert seg_b not in segments(tmp_path) and {seg_a, seg_c} <= set(segments(tmp_path))
    assert store.batch_exists(keys[4:8]) == 0 and store.batch_exists(keys[:4]) == 4
    assert_pages(store, pool, keys[12:], list(range(13, 17)))
    store.check_integrity()
    store.close()
    # the LRU order survives a restart with the index: B's pages stay gone, A's stay
    again = open_store(pool, tmp_path, segment_bytes=4 * RECORD, max_bytes=12 * RECORD)
    assert again.batch_exists(keys[:4]) == 4 and again.stats()["pages_stored"] == 12


def test_clear_removes_every_segment_and_the_index(pool, tmp_path):
    store = open_store(pool, tmp_path, segment_bytes=2 * RECORD)
    store.batch_set(page_keys(5), [1, 2, 3, 4, 5])
    store.flush_index()
    store.clear()
    assert os.listdir(ns_dir(tmp_path)) == [] and store.stats()["pages_stored"] == 0
    assert open_store(pool, tmp_path).batch_exists(page_keys(5)) == 0


def test_failed_write_is_reported_and_not_indexed(pool, tmp_path, monkeypatch):
    store = open_store(pool, tmp_path)
    real = file_store.write_all

    def disk_full(fd, buffers, offset):
        real(fd, buffers[:1], offset)  # half a record reaches the disk
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(file_store, "write_all", disk_full)
    keys = page_keys(3)
    assert store.batch_set(keys, [1, 2, 3]) == [False] * 3
    assert store.batch_exists(keys) == 0 and store.stats()["write_failures"] == 3
    monkeypatch.setattr(file_store, "write_all", real)
    assert store.batch_set(keys, [1, 2, 3]) == [True] * 3  # into a fresh segment
    assert len(segments(tmp_path)) == 2
    store.check_integrity()
    assert_pages(open_store(pool, tmp_path), pool, keys, [1, 2, 3])


def test_bad_extra_config_names_the_key(pool, tmp_path):
    with pytest.raises(ValueError, match="extra-config segment_bytes='big'"):
        open_store(pool, tmp_path, segment_bytes="big")
    with pytest.raises(ValueError, match="max_bytes .* must be at least segment_bytes"):
        open_store(pool, tmp_path, segment_bytes=1 << 20, max_bytes=1 << 10)
    with pytest.raises(ValueError, match="index_flush_every must be >= 1"):
        open_store(pool, tmp_path, index_flush_every=0)


def test_default_directory_honours_env_then_xdg(pool, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("KVSTRATA_HICACHE_FILE_DIR", raising=False)
    store = make_backend("file", pool)
    assert store.directory == str(tmp_path / "xdg" / "kvstrata" / "hicache" / NAMESPACE.name)
    monkeypatch.setenv("KVSTRATA_HICACHE_FILE_DIR", str(tmp_path / "env"))
    assert make_backend("file", pool).directory == str(tmp_path / "env" / NAMESPACE.name)


def test_two_processes_share_a_directory(pool, tmp_path):
    """A live writer process's pages are found by a reader that started before them; the
    reader's eviction skips the segment the writer still appends to, and takes it once the
    writer is gone."""
    reader = open_store(pool, tmp_path, refresh_interval_s=0, segment_bytes=8 * RECORD,
                        max_bytes=8 * RECORD)
    child = spawn_child("writer", backend="file", num_pages=3, seed=77, tag="child",
                        extra={"file_path": str(tmp_path)}, flush=False)
    child_keys, own = page_keys(3, "child"), page_keys(6, "own")
    try:
        assert wait_ready(child) == "ready 3"
        assert reader.batch_exists(child_keys) == 3  # found by rescanning the directory
        assert reader.batch_get(child_keys, [31, 32, 33]) == [True] * 3
        assert torch.equal(pool.get_flat_pages([31, 32, 33]), random_flat(3, seed=77))
        # 3 + 6 records exceed the cap, and the only other segment is the live writer's
        assert reader.batch_set(own, list(range(1, 7))) == [False] * 6
        assert reader.stats()["evicted_segments"] == 0
        assert reader.batch_get(child_keys, [31, 32, 33]) == [True] * 3
    finally:
        stop_child(child)
    assert reader.batch_set(own, list(range(1, 7))) == [True] * 6
    assert reader.stats()["evicted_segments"] == 1 and reader.batch_exists(child_keys) == 0
    assert_pages(reader, pool, own, list(range(1, 7)))


class FileStoreMachine(RuleBasedStateMachine):
    """Random sets, gets, restarts and clears against a dict model (no cap: nothing may be
    lost); every stored key reads back its exact page."""

    @initialize()
    def setup(self):
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="kvstrata-filestore-")
        self.pool = make_pool("page_head", 12)
        self.pool.set_flat_pages(list(range(1, 9)), random_flat(8, seed=4))
        self.store = open_store(self.pool, self.dir, segment_bytes=3 * RECORD)
        self.model: dict[str, int] = {}  # key -> source host page
        self.keys = page_keys(10, "m")

    @rule(picks=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 8)), max_size=5))
    def set_pages(self, picks):
        keys = [self.keys[k] for k, _ in picks]
        assert self.store.batch_set(keys, [page for _, page in picks]) == [True] * len(keys)
        for k, page in picks:
            self.model.setdefault(self.keys[k], page)

    @rule(idx=st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True))
    def get_pages(self, idx):
        keys = [self.keys[i] for i in idx]
        got = self.store.batch_get(keys, [9 + j for j in range(len(keys))])
        assert got == [k in self.model for k in keys]
        for j, key in enumerate(keys):
            if key in self.model:
                assert torch.equal(self.pool.get_flat_pages([9 + j])[0],
                                   self.pool.get_flat_pages([self.model[key]])[0])

    @rule(crash=st.booleans())
    def restart(self, crash):
        if not crash:
            self.store.close()
        self.store = open_store(self.pool, self.dir, segment_bytes=3 * RECORD)

    @rule()
    def clear(self):
        self.store.clear()
        self.model.clear()

    @invariant()
    def index_is_consistent(self):
        self.store.check_integrity()

    @invariant()
    def exists_is_the_model_prefix(self):
        expected = next((i for i, k in enumerate(self.keys) if k not in self.model), 10)
        assert self.store.batch_exists(self.keys) == expected

    def teardown(self):
        import shutil
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestFileStoreMachine = FileStoreMachine.TestCase
TestFileStoreMachine.settings = settings(max_examples=12, stateful_step_count=12,
                                         deadline=None)
