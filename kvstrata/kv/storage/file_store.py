"""`--hicache-storage-backend file`: flat KV pages in append-only segment files on local disk.

Layout: `<root>/<namespace.name>/` holds `<time_ns>-<pid>.seg` segments of records (format in
file_records.py: header with key and checksums, then the flat page) and `index.json` (key ->
segment, offset; file_index.py). `root` and the other extra-config keys: file_options.py.

Guarantees:
- never wrong data: every read checks the record's header crc32, key, length and payload sums
  (file_records.py); a failing record is a miss (and leaves the index); so is a torn tail.
- atomic per record: a record enters the index only after its bytes are written, and other
  processes only index records whose whole length is in the file.
- restart: the index is saved (temp file + rename) every `index_flush_every` new records and
  on close, and reconciled with the segments at start (file_index.py), so a lost or stale
  index costs a scan of the segment headers.
- size cap `max_bytes` (default: 10 GiB, or half of the free disk space at start if that is
  less): the least recently used whole segments are deleted to make room.

Concurrency: any number of processes may read and write one directory. Each process appends
only to its own segment (flock'ed while it is being written); a process finds records others
wrote by rescanning the directory when a key misses (at most every `refresh_interval_s`);
eviction never deletes a segment that a live process is still appending to; a reader whose
segment another process deleted keeps reading its open descriptor (POSIX unlink), or misses.
Within a process: one writer thread and one reader thread at a time (base.py's contract).
Segment files (which one a write appends to, eviction, other processes' records, read
descriptors): file_segments.py, a mixin.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from kvstrata.kv.storage.base import StorageBackend
from kvstrata.kv.storage.file_segments import SegmentFiles
from kvstrata.kv.storage.file_index import INDEX_FILE, SegmentIndex
from kvstrata.kv.storage.file_options import MiB, default_root, parse_options, resolve_max_bytes
from kvstrata.kv.storage.file_records import (HEADER, ActiveSegment, RecordError, encode_key,
                                              is_segment_name, parse_header, payload_sums,
                                              prefix_len, record_header, write_all)
from kvstrata.kv.storage.staging import FlatPageStaging

logger = logging.getLogger(__name__)

CHUNK_BYTES, MAX_CHUNK_PAGES = 64 * MiB, 128  # bounds the reused staging/read buffers


class FileStorage(SegmentFiles, StorageBackend):
    def __init__(self, config, host_pool):
        super().__init__(config, host_pool)
        opts = parse_options(config.extra)
        geom = host_pool.geom
        self.page_bytes = config.page_bytes
        self._dtype = geom.dtype
        self.directory = os.path.join(opts["file_path"] or default_root(),
                                      config.namespace.name)
        os.makedirs(self.directory, exist_ok=True)
        self.segment_bytes = opts["segment_bytes"]
        self._flush_every = opts["index_flush_every"]
        self._refresh_interval = opts["refresh_interval_s"]
        self._fsync = opts["fsync"]
        self._lock = threading.Lock()        # the index, fds, counters
        self._write_lock = threading.Lock()  # the active segment
        self._index = SegmentIndex()
        self._index_loaded = self._index.load(self.directory, self.page_bytes)
        self._index.reconcile(self.directory)
        self._last_refresh = time.monotonic()
        self.max_bytes = resolve_max_bytes(opts["max_bytes"], self.directory,
                                           self._index.total_bytes, self.segment_bytes,
                                           config.share)
        self._active: ActiveSegment | None = None
        self._read_fds: dict[str, int] = {}
        self._retired_fds: list[int] = []
        self._reads_in_flight = 0
        # pages per staged write / per read chunk: bounds the two reused buffers (~64 MiB)
        self._chunk_pages = max(1, min(MAX_CHUNK_PAGES, CHUNK_BYTES // self.page_bytes))
        # allocated (and touched) now: first-touch page faults would land on the first batch
        self._stager = FlatPageStaging(self.page_bytes, self._chunk_pages)
        # np.zeros would map lazily-zeroed memory (calloc): fill it to touch every page
        self._read_buf = np.empty((self._chunk_pages, self.page_bytes), dtype=np.uint8)
        self._read_buf.fill(0)
        self._read_buf_lock = threading.Lock()
        self._unsaved = 0
        self._stats = dict.fromkeys(
            ("pages_read", "pages_written", "bytes_read", "bytes_written", "pages_skipped",
             "read_misses", "corrupt_records", "write_failures", "evicted_segments",
             "evicted_pages", "evicted_bytes", "refreshes"), 0)
        logger.info("file storage at %s: %d pages in %d segments (index %s, %d segments "
                    "scanned), cap %.2f GB", self.directory, len(self._index),
                    len(self._index.segments), "loaded" if self._index_loaded else "rebuilt",
                    self._index.scanned_segments, self.max_bytes / 1e9)

    # ---- verbs ------------------------------------------------------------------------------

    def batch_exists(self, keys: list[str]) -> int:
        hits = self._count_hits(keys)
        if hits < len(keys) and self._maybe_refresh():
            hits = self._count_hits(keys)
        return hits

    def _count_hits(self, keys: list[str]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._index:
                    return i
        return len(keys)

    def batch_get(self, keys: list[str], host_pages: list[int]) -> list[bool]:
        self._check_batch(keys, host_pages)
        if not all(k in self._index for k in keys):
            self._maybe_refresh()
        with self._lock:
            wanted = [(i, self._index.locate(k)) for i, k in enumerate(keys)]
            wanted = [(i, loc[0], loc[1], self._read_fd(loc[0])) for i, loc in wanted
                      if loc is not None]
            self._reads_in_flight += 1
        ok = [False] * len(keys)
        bad = []  # (key, segment) of records that failed their checks
        try:
            with self._read_buf_lock:
                for start in range(0, len(wanted), self._chunk_pages):
                    self._read_chunk(keys, host_pages, wanted[start:start + self._chunk_pages],
                                     ok, bad)
        finally:
            with self._lock:
                self._reads_in_flight -= 1
                self._close_retired()
        now = time.time()
        with self._lock:
            for key, seg in bad:
                if self._index.locations.get(key) == seg:
                    self._index.drop_key(key)  # a bad record stays a miss; set may rewrite it
            for _i, seg, _offset, _fd in wanted:
                self._index.touch(seg, now)
            hits = sum(ok)
            self._stats["corrupt_records"] += len(bad)
            self._stats["read_misses"] += len(keys) - hits
            self._stats["pages_read"] += hits
            self._stats["bytes_read"] += hits * self.page_bytes
        return ok

    def _read_chunk(self, keys, host_pages, wanted, ok, bad) -> None:
        """Read records into the reused buffer (fresh memory would cost page faults on every
        batch), check their payload sums in one vectorised pass, then one set_flat_pages for
        the good ones."""
        rows = self._read_buf
        headers = [self._read_record(fd, offset, keys[i], rows[row]) if fd is not None else None
                   for row, (i, _seg, offset, fd) in enumerate(wanted)]
        flat = torch.from_numpy(rows[:len(wanted)])
        sums = payload_sums(flat)
        good = []
        for row, (i, seg, offset, _fd) in enumerate(wanted):
            if headers[row] is not None and headers[row].sums == sums[row]:
                ok[i] = True
                good.append(row)
            else:
                if headers[row] is not None:
                    logger.warning("storage record %s at %s:%d: payload checksum mismatch, "
                                   "a miss", keys[i][:16], seg, offset)
                bad.append((keys[i], seg))
        if good:
            flat = flat.view(self._dtype)
            if len(good) < len(wanted):
                flat = flat[good]
            self.host_pool.set_flat_pages([host_pages[wanted[r][0]] for r in good], flat)

    def _read_record(self, fd: int, offset: int, key: str, out: np.ndarray):
        """Read one record's payload into `out`; its checked header, or None (a miss)."""
        key_bytes = key.encode()
        head = bytearray(prefix_len(key_bytes))
        try:
            n = os.preadv(fd, [head, out], offset)
            if n != len(head) + self.page_bytes:
                raise RecordError(f"short read ({n} bytes)")
            header = parse_header(bytes(head[:HEADER.size]), bytes(head[HEADER.size:]))
            if header.key != key_bytes or header.payload_len != self.page_bytes:
                raise RecordError("record of another key or size")
            return header
        except (OSError, RecordError) as e:
            logger.warning("storage record %s at offset %d unusable (%s): a miss", key[:16],
                           offset, e)
            return None

    def batch_set(self, keys: list[str], host_pages: list[int]) -> list[bool]:
        self._check_batch(keys, host_pages)
        now = time.time()
        with self._lock:
            todo, seen = [], set()
            for i, key in enumerate(keys):
                loc = self._index.locations.get(key)
                if loc is not None:
                    self._index.touch(loc, now)  # asked again: keep it warm
                elif key not in seen:
                    seen.add(key)
                    todo.append(i)
            self._stats["pages_skipped"] += len(keys) - len(todo)
        ok = [True] * len(keys)
        if not todo:
            return ok
        key_bytes = {i: encode_key(keys[i]) for i in todo}  # bad keys fail before any write
        done = set()
        with self._write_lock:
            for part in self._stager.chunks(todo):
                rows = self._stager.gather(self.host_pool, [host_pages[i] for i in part])
                n = self._append([key_bytes[i] for i in part], rows.numpy(),
                                 payload_sums(rows), [keys[i] for i in part])
                done.update(keys[i] for i in part[:n])
                if n < len(part):
                    break
        for i, key in enumerate(keys):
            if key in seen and key not in done:
                ok[i] = False  # not written (a duplicate of it neither)
        if done and self._unsaved >= self._flush_every:
            self.flush_index()
        return ok

    def _append(self, key_bytes: list[bytes], payloads: np.ndarray,
                sums: list[tuple[int, int]], keys: list[str]) -> int:
        """Write records in order; returns how many were written (the rest failed)."""
        pos = 0
        while pos < len(keys):
            try:
                seg = self._writable_segment(prefix_len(key_bytes[pos]) + self.page_bytes)
            except OSError as e:
                logger.error("file storage cannot open a segment in %s: %s", self.directory, e)
                break
            room, take, chunk_bytes = self.segment_bytes - seg.size, 0, 0
            while pos + take < len(keys):
                size = prefix_len(key_bytes[pos + take]) + self.page_bytes
                if take and chunk_bytes + size > room:
                    break
                take, chunk_bytes = take + 1, chunk_bytes + size
            if not self._make_room(chunk_bytes):
                logger.warning("file storage full (%d bytes cap) and nothing evictable: "
                               "%d pages not stored", self.max_bytes, len(keys) - pos)
                break
            buffers, offsets, offset = [], [], seg.size
            for j in range(pos, pos + take):
                buffers += [record_header(key_bytes[j], self.page_bytes, sums[j]), payloads[j]]
                offsets.append(offset)
                offset += prefix_len(key_bytes[j]) + self.page_bytes
            try:
                write_all(seg.fd, buffers, seg.size)
            except OSError as e:
                logger.error("file storage write failed in %s: %s", seg.name, e)
                seg.broken = True
                with self._lock:
                    self._stats["write_failures"] += len(keys) - pos
                break
            now = time.time()
            with self._lock:
                for j, rec_offset in zip(range(pos, pos + take), offsets):
                    self._index.add(seg.name, keys[j], rec_offset,
                                    rec_offset + prefix_len(key_bytes[j]) + self.page_bytes, now)
                self._index.touch(seg.name, now)
                self._stats["pages_written"] += take
                self._stats["bytes_written"] += take * self.page_bytes
                self._unsaved += take
            seg.size += chunk_bytes
            pos += take
        return pos

    # ---- housekeeping -----------------------------------------------------------------------

    def flush_index(self) -> None:
        with self._lock:
            self._index.save(self.directory, self.page_bytes)
            self._unsaved = 0

    def clear(self) -> None:
        """Delete every segment of this namespace (all processes'), and the index."""
        with self._write_lock:
            if self._active is not None:
                self._active.close(False)
                self._active = None
            with self._lock:
                for name in os.listdir(self.directory):
                    if is_segment_name(name) or name == INDEX_FILE:
                        try:
                            os.unlink(os.path.join(self.directory, name))
                        except FileNotFoundError:
                            pass
                for name in list(self._read_fds):
                    self._retire_fd(name)
                self._index = SegmentIndex()
                self._unsaved = 0

    def check_integrity(self) -> None:
        """The index is self-consistent and the segment this process appends to is exactly
        as long as the records it indexed there (AssertionError otherwise)."""
        with self._lock:
            self._index.check_integrity()
            if self._active is not None:
                size = os.fstat(self._active.fd).st_size
                covered = self._index.segments[self._active.name].covered
                assert self._active.broken or size == self._active.size == covered, \
                    f"active segment {self._active.name}: {size} bytes on disk, " \
                    f"{self._active.size} written, {covered} indexed"

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self._stats, "pages_stored": len(self._index),
                    "bytes_stored": self._index.total_bytes,
                    "segments": len(self._index.segments), "max_bytes": self.max_bytes,
                    "index_loaded": self._index_loaded,
                    "segments_scanned": self._index.scanned_segments}

    def close(self) -> None:
        with self._write_lock:
            if self._active is not None:
                self._active.close(self._fsync)
                self._active = None
            self.flush_index()
            with self._lock:
                for name in list(self._read_fds):
                    self._retire_fd(name)
