"""The key -> record index of the `file` storage backend, its persistence and its rebuild.

The segments are the truth; the index is a cache of their headers. `reconcile()` makes it
agree with the directory: segments it has never seen are scanned from the start, segments that
grew (another writer, or records written after the index was saved) are scanned from where
the index stopped, segments shorter than the index thought (truncated) are rescanned from the
start, and segments that are gone (evicted by another process, deleted) are dropped. So a
lost, stale or foreign index costs a scan, never a wrong answer.

index.json is written whole to a temporary file and renamed over the old one (os.replace is
atomic), so a reader sees the old or the new index, never half of one. Several processes may
save it; the last one wins, and the others' additions are found again by the next reconcile.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from kvstrata.kv.storage.file_records import is_segment_name, scan_segment

logger = logging.getLogger(__name__)

INDEX_FILE = "index.json"
INDEX_VERSION = 1


@dataclass
class SegmentEntry:
    covered: int                  # bytes of whole, valid records from the start of the file
    last_access: float            # time.time() of the last read, write or skip (LRU)
    records: dict[str, int] = field(default_factory=dict)  # key -> record offset


class SegmentIndex:
    """Where each stored key's record is. Not thread-safe: FileStorage holds its lock."""

    def __init__(self):
        self.segments: dict[str, SegmentEntry] = {}
        self.locations: dict[str, str] = {}  # key -> segment name (its latest record)
        self.scanned_segments = 0            # how many segments a reconcile had to scan

    def __contains__(self, key: str) -> bool:
        return key in self.locations

    def __len__(self) -> int:
        return len(self.locations)

    @property
    def total_bytes(self) -> int:
        return sum(seg.covered for seg in self.segments.values())

    def locate(self, key: str) -> tuple[str, int] | None:
        name = self.locations.get(key)
        return None if name is None else (name, self.segments[name].records[key])

    def add(self, name: str, key: str, offset: int, end: int, now: float) -> None:
        seg = self.segments.setdefault(name, SegmentEntry(0, now))
        seg.records[key] = offset
        seg.covered = max(seg.covered, end)
        self.locations[key] = name

    def add_segment(self, name: str, now: float) -> None:
        self.segments.setdefault(name, SegmentEntry(0, now))

    def touch(self, name: str, now: float) -> None:
        if name in self.segments:
            self.segments[name].last_access = now

    def drop_key(self, key: str) -> None:
        name = self.locations.pop(key, None)
        if name is not None:
            self.segments[name].records.pop(key, None)

    def drop_segment(self, name: str) -> int:
        """Forget a segment; returns how many keys lived there."""
        seg = self.segments.pop(name, None)
        if seg is None:
            return 0
        gone = [k for k in seg.records if self.locations.get(k) == name]
        for key in gone:
            del self.locations[key]
        return len(gone)

    def check_integrity(self) -> None:
        """Every located key is recorded in its segment at an offset below what the segment
        covers; raises AssertionError naming the first inconsistency."""
        for key, name in self.locations.items():
            seg = self.segments.get(name)
            assert seg is not None, f"key {key[:16]} located in unknown segment {name}"
            assert key in seg.records, f"key {key[:16]} missing from its segment {name}"
            assert seg.records[key] < seg.covered, f"key {key[:16]} beyond {name}'s end"

    def lru_order(self) -> list[str]:
        return sorted(self.segments, key=lambda n: (self.segments[n].last_access, n))

    # ---- persistence -----------------------------------------------------------------------

    def save(self, directory: str, page_bytes: int) -> None:
        doc = {"version": INDEX_VERSION, "page_bytes": page_bytes,
               "segments": {name: {"covered": seg.covered, "last_access": seg.last_access,
                                   "records": seg.records}
                            for name, seg in self.segments.items()}}
        tmp = os.path.join(directory, f".{INDEX_FILE}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, os.path.join(directory, INDEX_FILE))

    def load(self, directory: str, page_bytes: int) -> bool:
        """Adopt index.json when it is readable and of this version/page size; False if not
        (reconcile then scans every segment)."""
        path = os.path.join(directory, INDEX_FILE)
        try:
            with open(path) as f:
                doc = json.load(f)
            if doc["version"] != INDEX_VERSION or doc["page_bytes"] != page_bytes:
                raise ValueError("index of another version or page size")
            for name, raw in doc["segments"].items():
                seg = SegmentEntry(int(raw["covered"]), float(raw["last_access"]),
                                   {str(k): int(v) for k, v in raw["records"].items()})
                self.segments[name] = seg
                for key in seg.records:
                    self.locations[key] = name
            return True
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("ignoring unreadable storage index %s (%s); rebuilding it from "
                           "the segment headers", path, e)
            self.segments.clear()
            self.locations.clear()
            return False

    # ---- agreeing with the directory -------------------------------------------------------

    def reconcile(self, directory: str, *, skip: frozenset = frozenset()) -> list[str]:
        """Make the index match the segment files (see the module docstring); returns the
        names of segments that disappeared. `skip`: segments this process is writing."""
        on_disk = {}
        with os.scandir(directory) as it:
            for entry in it:
                if is_segment_name(entry.name):
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    on_disk[entry.name] = st
        gone = [name for name in self.segments if name not in on_disk and name not in skip]
        for name in gone:
            self.drop_segment(name)
        for name, st in sorted(on_disk.items()):
            if name in skip:
                continue
            seg = self.segments.get(name)
            if seg is not None and st.st_size == seg.covered:
                continue
            if seg is not None and st.st_size < seg.covered:
                self.drop_segment(name)  # truncated: what the index knew may be gone
                seg = None
            self._scan(directory, name, 0 if seg is None else seg.covered, st)
        return gone

    def _scan(self, directory: str, name: str, start: int, st: os.stat_result) -> None:
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        except FileNotFoundError:
            return
        self.scanned_segments += 1
        try:
            seg = self.segments.setdefault(name, SegmentEntry(start, st.st_mtime))
            for offset, header in scan_segment(fd, start, st.st_size):
                self.add(name, header.key.decode(errors="replace"), offset,
                         offset + header.record_len, seg.last_access)
        finally:
            os.close(fd)
