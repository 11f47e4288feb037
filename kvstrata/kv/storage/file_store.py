"""`--hicache-storage-backend file`: flat KV pages in append-only segment files on local disk.

Layout: `<root>/<namespace.name>/` holds `<time_ns>-<pid>.seg` segments of records (format in
file_records.py: header with key and checksums, then the flat page) and `index.json` (key ->
segment, offset; file_index.py). `root` is the extra-config key `file_path`, else
KVSTRATA_HICACHE_FILE_DIR, else `$XDG_CACHE_HOME/kvstrata/hicache` (`~/.cache/...`).

Guarantees:
- never wrong data: every read checks the record's header checksum, key, length and payload
  crc32; a record that fails is a miss (and leaves the index). A torn tail at restart (a
  writer died mid-record) is ignored by the scan.
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
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time
from typing import Any

import numpy as np
import torch

from kvstrata import envs
from kvstrata.kv.storage.base import PREFETCH_CONFIG_KEYS, StorageBackend
from kvstrata.kv.storage.file_index import INDEX_FILE, SegmentIndex
from kvstrata.kv.storage.file_records import (HEADER, RecordError, check_payload, encode_key,
                                              is_segment_name, parse_header, prefix_len,
                                              record_header, segment_name, write_all)

logger = logging.getLogger(__name__)

MiB, GiB = 1 << 20, 1 << 30
DEFAULT_SEGMENT_BYTES = 128 * MiB
DEFAULT_MAX_BYTES = 10 * GiB
# extra-config keys of this backend, with their types and defaults (None = computed)
OPTIONS = {"file_path": (str, None), "segment_bytes": (int, DEFAULT_SEGMENT_BYTES),
           "max_bytes": (int, None), "index_flush_every": (int, 1024),
           "refresh_interval_s": (float, 1.0), "fsync": (bool, False)}
SHARED_KEYS = set(PREFETCH_CONFIG_KEYS) | {"key_salt"}  # read by other layers


def default_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return envs.KVSTRATA_HICACHE_FILE_DIR.get() or os.path.join(base, "kvstrata", "hicache")


def parse_options(extra: dict[str, Any]) -> dict[str, Any]:
    opts = {}
    for name, (kind, default) in OPTIONS.items():
        raw = extra.get(name, default)
        if raw is not None and not isinstance(raw, kind):
            try:
                raw = kind(raw) if kind is not bool else str(raw).lower() in ("1", "true")
            except (TypeError, ValueError):
                raise ValueError(f"--hicache-storage-backend-extra-config {name}={raw!r} is "
                                 f"not a valid {kind.__name__}") from None
        opts[name] = raw
    for name in ("segment_bytes", "max_bytes", "index_flush_every"):
        if opts[name] is not None and opts[name] < 1:
            raise ValueError(f"--hicache-storage-backend-extra-config {name} must be >= 1, "
                             f"got {opts[name]}")
    unknown = sorted(set(extra) - set(OPTIONS) - SHARED_KEYS)
    if unknown:
        logger.warning("file storage ignores unknown extra-config keys %s (it reads %s)",
                       unknown, ", ".join(OPTIONS))
    return opts


class _ActiveSegment:
    """The segment this process appends to: exclusive flock, its own write position."""

    def __init__(self, directory: str):
        self.name = segment_name(time.time_ns(), os.getpid())
        self.fd = os.open(os.path.join(directory, self.name),
                          os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.size = 0
        self.broken = False  # a failed write left a torn tail: never append after it

    def close(self, fsync: bool) -> None:
        if fsync:
            os.fdatasync(self.fd)
        os.close(self.fd)  # releases the flock


class FileStorage(StorageBackend):
    def __init__(self, config, host_pool):
        super().__init__(config, host_pool)
        opts = parse_options(config.extra)
        geom = host_pool.geom
        if geom.bytes_per_page != config.page_bytes:
            raise ValueError(f"storage page_bytes {config.page_bytes} != host pool page "
                             f"bytes {geom.bytes_per_page}")
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
        self.max_bytes = self._resolve_max_bytes(opts["max_bytes"])
        self._active: _ActiveSegment | None = None
        self._read_fds: dict[str, int] = {}
        self._retired_fds: list[int] = []
        self._reads_in_flight = 0
        self._unsaved = 0
        self._stats = dict.fromkeys(
            ("pages_read", "pages_written", "bytes_read", "bytes_written", "pages_skipped",
             "read_misses", "corrupt_records", "write_failures", "evicted_segments",
             "evicted_pages", "evicted_bytes", "refreshes"), 0)
        logger.info("file storage at %s: %d pages in %d segments (index %s, %d segments "
                    "scanned), cap %.2f GB", self.directory, len(self._index),
                    len(self._index.segments), "loaded" if self._index_loaded else "rebuilt",
                    self._index.scanned_segments, self.max_bytes / 1e9)

    def _resolve_max_bytes(self, requested: int | None) -> int:
        if requested is None:
            free = shutil.disk_usage(self.directory).free
            requested = min(DEFAULT_MAX_BYTES, (free + self._index.total_bytes) // 2)
            requested = max(requested, 2 * self.segment_bytes)
        if requested < self.segment_bytes:
            raise ValueError(f"--hicache-storage-backend-extra-config max_bytes ({requested}) "
                             f"must be at least segment_bytes ({self.segment_bytes}): "
                             "eviction deletes whole segments")
        return requested

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
        rows = np.empty((len(wanted), self.page_bytes), dtype=np.uint8)
        ok = [False] * len(keys)
        good_rows, bad = [], []
        try:
            for row, (i, seg, offset, fd) in enumerate(wanted):
                if fd is not None and self._read_record(fd, offset, keys[i], rows[row]):
                    ok[i] = True
                    good_rows.append(row)
                else:
                    bad.append((keys[i], seg))
        finally:
            with self._lock:
                self._reads_in_flight -= 1
                self._close_retired()
        if good_rows:
            flat = torch.from_numpy(rows).view(self._dtype)
            if len(good_rows) < len(rows):
                flat = flat[good_rows]
            self.host_pool.set_flat_pages([host_pages[wanted[r][0]] for r in good_rows], flat)
        now = time.time()
        with self._lock:
            for key, seg in bad:
                if self._index.locations.get(key) == seg:
                    self._index.drop_key(key)  # a bad record stays a miss; set may rewrite it
            for r in good_rows:
                self._index.touch(wanted[r][1], now)
            self._stats["corrupt_records"] += sum(seg is not None for _, seg in bad)
            self._stats["read_misses"] += len(keys) - len(good_rows)
            self._stats["pages_read"] += len(good_rows)
            self._stats["bytes_read"] += len(good_rows) * self.page_bytes
        return ok

    def _read_record(self, fd: int, offset: int, key: str, out: np.ndarray) -> bool:
        key_bytes = key.encode()
        head = bytearray(prefix_len(key_bytes))
        try:
            n = os.preadv(fd, [head, out], offset)
            if n != len(head) + self.page_bytes:
                raise RecordError(f"short read ({n} bytes)")
            header = parse_header(bytes(head[:HEADER.size]), bytes(head[HEADER.size:]))
            if header.key != key_bytes or header.payload_len != self.page_bytes:
                raise RecordError("record of another key or size")
            check_payload(header, out)
            return True
        except (OSError, RecordError) as e:
            logger.warning("storage record %s at offset %d unusable (%s): a miss", key[:16],
                           offset, e)
            return False

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
        key_bytes = [encode_key(keys[i]) for i in todo]
        flat = self.host_pool.get_flat_pages([host_pages[i] for i in todo])
        payloads = flat.view(torch.uint8).numpy()
        with self._write_lock:
            written = self._append(key_bytes, payloads, [keys[i] for i in todo])
        for j, i in enumerate(todo):
            ok[i] = j < written
        done = {keys[i] for i in todo[:written]}
        for i, key in enumerate(keys):
            if key in seen and key not in done:
                ok[i] = False  # a duplicate of a page that failed to write
        if written and self._unsaved >= self._flush_every:
            self.flush_index()
        return ok

    def _append(self, key_bytes: list[bytes], payloads: np.ndarray, keys: list[str]) -> int:
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
                buffers += [record_header(key_bytes[j], payloads[j]), payloads[j]]
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

    def _writable_segment(self, record_bytes: int) -> _ActiveSegment:
        seg = self._active
        if seg is not None and not seg.broken and (
                seg.size == 0 or seg.size + record_bytes <= self.segment_bytes):
            return seg
        if seg is not None:
            seg.close(self._fsync)
        self._active = _ActiveSegment(self.directory)
        with self._lock:
            self._index.add_segment(self._active.name, time.time())
        return self._active

    def _make_room(self, incoming: int) -> bool:
        """Delete least recently used whole segments until `incoming` bytes fit the cap."""
        with self._lock:
            active = self._active.name if self._active else None
            for name in self._index.lru_order():
                if self._index.total_bytes + incoming <= self.max_bytes:
                    break
                if name != active:
                    self._evict(name)
            return self._index.total_bytes + incoming <= self.max_bytes

    def _evict(self, name: str) -> None:
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            fd = None  # another process deleted it already
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return  # a live process is still appending to it
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            os.close(fd)
        size = self._index.segments[name].covered
        self._stats["evicted_pages"] += self._index.drop_segment(name)
        self._stats["evicted_segments"] += 1
        self._stats["evicted_bytes"] += size
        self._retire_fd(name)

    # ---- other processes' writes, fds -------------------------------------------------------

    def _maybe_refresh(self) -> bool:
        """Rescan the directory for records other processes wrote (rate-limited)."""
        if time.monotonic() - self._last_refresh < self._refresh_interval:
            return False
        with self._lock:
            self._last_refresh = time.monotonic()
            skip = frozenset([self._active.name]) if self._active else frozenset()
            for name in self._index.reconcile(self.directory, skip=skip):
                self._retire_fd(name)
            self._stats["refreshes"] += 1
        return True

    def _read_fd(self, name: str) -> int | None:
        fd = self._read_fds.get(name)
        if fd is None:
            try:
                fd = os.open(os.path.join(self.directory, name), os.O_RDONLY)
            except FileNotFoundError:
                return None
            self._read_fds[name] = fd
        return fd

    def _retire_fd(self, name: str) -> None:
        # the reader thread may be using it right now: close it once no read is in flight
        fd = self._read_fds.pop(name, None)
        if fd is not None:
            self._retired_fds.append(fd)
        self._close_retired()

    def _close_retired(self) -> None:
        if self._reads_in_flight == 0:
            for fd in self._retired_fds:
                os.close(fd)
            self._retired_fds.clear()

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
