"""On-disk record format of the `file` storage backend (file_store.py), and segment scanning.

A segment is an append-only file of records, each written whole by one `pwritev`:

  | header (36 bytes)                                             | key        | payload       |
  | magic "KVSR" | version u8 | flags u8 | key_len u16 | payload_len u64 |      |               |
  | payload_sum u64 | payload_weighted_sum u64 | header_crc u32    | key_len B  | payload_len B |

All integers are little-endian. `header_crc` (zlib crc32) covers the header bytes before it
and the key, so a scan can trust `payload_len` to find the next record without reading the
payload. The payload check is two 64-bit sums over the payload's little-endian 64-bit words,
modulo 2**64: plain (S1) and weighted by position (S2 = sum of (i + 1) * word_i). Any change
of one word changes S1; moved or swapped words change S2; a torn (zero-filled) or truncated
payload fails one or the length check. Why not crc32 of the payload: zlib's crc32 runs at
2.5-4 GB/s on one core here, below a warm sequential read (6-10 GB/s), so it alone would cap
reads at ~30% of the raw file bandwidth; the sums are two vectorised torch reductions over a
whole batch (~10 GB/s on one core, docs/benchmarks.md). Integer sums wrap, so the order of
summation does not matter and every process computes the same values.

A record that fails any check is a miss, never data. A scan stops at the first record that is
incomplete or fails its header check: that is the torn tail of a writer that died mid-record
(or a corrupted region, whose later records are then lost rather than trusted).
"""
from __future__ import annotations

import errno
import fcntl
import os
import time
import struct
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"KVSR"
VERSION = 1
HEADER = struct.Struct("<4sBBHQQQI")  # magic, version, flags, key_len, payload_len, sums, crc
HEADER_CRC_SPAN = HEADER.size - 4     # header_crc covers everything before itself (+ key)
MAX_KEY_BYTES = 1024
SEGMENT_SUFFIX = ".seg"
U64 = (1 << 64) - 1
# writev/pwritev take at most IOV_MAX buffers (1024 on Linux).
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_weights: dict[int, torch.Tensor] = {}


class RecordError(ValueError):
    """A record that is truncated, corrupted or not what the index said it was."""


def encode_key(key: str) -> bytes:
    raw = key.encode()
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"storage keys must be 1..{MAX_KEY_BYTES} bytes, got {len(raw)}")
    return raw


def payload_sums(rows: torch.Tensor) -> list[tuple[int, int]]:
    """(S1, S2) of each row of a (n, nbytes) uint8 tensor, as unsigned 64-bit ints."""
    n, nbytes = rows.shape
    if nbytes % 8:  # pad to whole words with zeros (a rare odd-sized page)
        padded = torch.zeros((n, nbytes + 8 - nbytes % 8), dtype=torch.uint8)
        padded[:, :nbytes] = rows
        rows = padded
    words = rows.view(torch.int64)
    weights = _weights.get(words.shape[1])
    if weights is None:
        weights = _weights[words.shape[1]] = torch.arange(1, words.shape[1] + 1,
                                                          dtype=torch.int64)
    s1, s2 = words.sum(dim=1).tolist(), torch.mv(words, weights).tolist()
    return [(a & U64, b & U64) for a, b in zip(s1, s2)]


def record_header(key_bytes: bytes, payload_len: int, sums: tuple[int, int]) -> bytes:
    """Header + key of one record."""
    head = struct.pack("<4sBBHQQQ", MAGIC, VERSION, 0, len(key_bytes), payload_len, *sums)
    return head + struct.pack("<I", zlib.crc32(key_bytes, zlib.crc32(head))) + key_bytes


def prefix_len(key_bytes: bytes) -> int:
    """Bytes of header + key, i.e. the payload's offset inside its record."""
    return HEADER.size + len(key_bytes)


@dataclass(frozen=True)
class ParsedHeader:
    key: bytes
    payload_len: int
    sums: tuple[int, int]

    @property
    def record_len(self) -> int:
        return HEADER.size + len(self.key) + self.payload_len


def parse_header(head: bytes, key: bytes) -> ParsedHeader:
    """Check a record's header + key bytes; RecordError when they are not a valid record."""
    if len(head) < HEADER.size:
        raise RecordError("truncated header")
    magic, version, _flags, key_len, payload_len, s1, s2, header_crc = HEADER.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise RecordError(f"bad magic/version {magic!r}/{version}")
    if len(key) != key_len:
        raise RecordError("truncated key")
    if zlib.crc32(key, zlib.crc32(head[:HEADER_CRC_SPAN])) != header_crc:
        raise RecordError("header checksum mismatch")
    return ParsedHeader(key, payload_len, (s1, s2))


def write_all(fd: int, buffers: list, offset: int) -> int:
    """pwritev every buffer at `offset`, resuming after short writes; returns bytes written.
    On an OSError the region past `offset` may hold a partial record (a torn tail)."""
    views = [memoryview(b).cast("B") for b in buffers]
    written = 0
    i = 0
    while i < len(views):
        n = os.pwritev(fd, views[i:i + IOV_MAX], offset + written)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        written += n
        while i < len(views) and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if n:
            views[i] = views[i][n:]
    return written


def scan_segment(fd: int, start: int, end: int):
    """Yield (record_offset, ParsedHeader) for each valid record header from `start` up to
    `end` (the file size), stopping at the first torn or corrupted one. The payload is not
    read (its checksum is verified when it is read)."""
    offset = start
    while offset + HEADER.size <= end:
        head = os.pread(fd, HEADER.size, offset)
        try:
            if len(head) < HEADER.size:
                return
            key_len = HEADER.unpack_from(head)[3]
            key = os.pread(fd, key_len, offset + HEADER.size) if key_len <= MAX_KEY_BYTES else b""
            header = parse_header(head, key)
        except RecordError:
            return
        if offset + header.record_len > end:
            return  # payload cut short: a torn tail
        yield offset, header
        offset += header.record_len


def segment_name(time_ns: int, pid: int) -> str:
    """Creation-ordered, unique per writer: `<time_ns>-<pid>.seg`."""
    return f"{time_ns:020d}-{pid}{SEGMENT_SUFFIX}"


def is_segment_name(name: str) -> bool:
    stem = name[:-len(SEGMENT_SUFFIX)]
    return name.endswith(SEGMENT_SUFFIX) and stem.replace("-", "").isdigit()


class ActiveSegment:
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
