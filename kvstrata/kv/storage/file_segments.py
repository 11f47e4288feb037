"""FileStorage's segment half (file_store.py keeps the verbs and housekeeping): which segment
a write appends to, the size cap's least-recently-used eviction of whole segments (never one
a live process still appends to: its flock), the rate-limited rescan that finds records
other processes wrote, and the read descriptors (closed only when no read is in flight). A
mixin: it reads the store's directory, index, locks, options and counters.
"""
from __future__ import annotations

import fcntl
import os
import time

from kvstrata.kv.storage.file_records import ActiveSegment


class SegmentFiles:
    # ---- the segment a write goes to, the size cap ------------------------------------------

    def _writable_segment(self, record_bytes: int) -> ActiveSegment:
        seg = self._active
        if seg is not None and not seg.broken and (
                seg.size == 0 or seg.size + record_bytes <= self.segment_bytes):
            return seg
        if seg is not None:
            seg.close(self._fsync)
        self._active = ActiveSegment(self.directory)
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
