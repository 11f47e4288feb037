"""The native page copy (kvstrata.kv.rowcopy / csrc/rowcopy.c) against torch indexing."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvstrata.kv import rowcopy


def _words(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**62, 2**62, (n,), generator=g, dtype=torch.int64)


def _t(*xs):
    return torch.tensor(xs, dtype=torch.long)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("row_bytes", [8, 24, 48, 64, 256, 12288])
def test_two_level_offsets_match_torch_indexing(row_bytes, streaming):
    """Rows at page offset + row offset, pages and row patterns scattered on both sides."""
    w = row_bytes // 8
    src, dst = _words(64 * w, 1), _words(96 * w, 2)
    g = torch.Generator().manual_seed(3)
    # 5 "pages" of 3 rows; a page starts anywhere, its rows follow a per-side pattern.
    src_pages = torch.randperm(8, generator=g)[:5] * 8 * row_bytes
    dst_pages = torch.randperm(12, generator=g)[:5] * 8 * row_bytes
    src_rows, dst_rows = _t(5, 0, 2) * row_bytes, _t(1, 7, 4) * row_bytes
    expect = dst.clone()
    for sp, dp in zip(src_pages.tolist(), dst_pages.tolist()):
        for sr, dr in zip(src_rows.tolist(), dst_rows.tolist()):
            a, b = (dp + dr) // 8, (sp + sr) // 8
            expect[a:a + w] = src[b:b + w]
    used = rowcopy.copy_pages(dst, src, dst_pages, src_pages, dst_rows, src_rows, row_bytes,
                              streaming=streaming)
    assert torch.equal(dst, expect)
    # Streaming stores need 16-byte aligned destination rows; torch allocations are aligned.
    assert used == (streaming and row_bytes % 16 == 0)


def test_unaligned_destination_falls_back_to_memcpy():
    src = _words(16, 1)
    raw = torch.zeros(16 * 8 + 8, dtype=torch.uint8)
    dst = raw[8:]
    used = rowcopy.copy_pages(dst, src, _t(0, 64), _t(64, 0), _t(0, 32), _t(0, 32), 32,
                              streaming=True)
    s = src.view(torch.uint8)
    assert not used
    assert torch.equal(dst[:64], s[64:128]) and torch.equal(dst[64:128], s[:64])


def test_size_decides_streaming(monkeypatch):
    src, dst = _words(8, 1), _words(8, 2)
    args = (dst, src, _t(0), _t(0), _t(0, 16, 32, 48), _t(0, 16, 32, 48), 16)
    monkeypatch.setattr(rowcopy, "STREAMING_MIN_BYTES", 64)
    assert rowcopy.copy_pages(*args)
    monkeypatch.setattr(rowcopy, "STREAMING_MIN_BYTES", 65)
    assert not rowcopy.copy_pages(*args)


def test_out_of_bounds_offsets_raise_and_copy_nothing():
    src, dst = _words(8, 1), _words(8, 2)  # 64 bytes each
    before = dst.clone()
    with pytest.raises(IndexError, match="destination"):
        rowcopy.copy_pages(dst, src, _t(0, 40), _t(0, 8), _t(0, 16), _t(0, 16), 16)
    with pytest.raises(IndexError, match="source"):
        rowcopy.copy_pages(dst, src, _t(0, 8), _t(0, -8), _t(0), _t(0), 16)
    with pytest.raises(IndexError, match="source"):
        rowcopy.copy_pages(dst, src, _t(0), _t(0), _t(0), _t(56), 16)
    assert torch.equal(dst, before)


def test_bad_arguments_are_value_errors():
    src, dst = _words(8, 1), _words(8, 2)
    with pytest.raises(ValueError, match="int64"):
        rowcopy.copy_pages(dst, src, _t(0).int(), _t(0), _t(0), _t(0), 16)
    with pytest.raises(ValueError, match="pair up"):
        rowcopy.copy_pages(dst, src, _t(0, 16), _t(0), _t(0), _t(0), 16)
    with pytest.raises(ValueError, match="contiguous CPU"):
        rowcopy.copy_pages(dst.view(2, 4).t(), src, _t(0), _t(0), _t(0), _t(0), 16)
    with pytest.raises(ValueError, match="row_bytes"):
        rowcopy.copy_pages(dst, src, _t(0), _t(0), _t(0), _t(0), 0)


def test_copy_releases_the_gil():
    """The transfer worker copies while the scheduler thread runs: during one native call on
    this thread, another Python thread must get to run. With the GIL held it never could run
    between the two timestamps taken around the call; with it released it may still miss a
    short call on a busy box, so up to five calls are tried."""
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.zeros(256 << 20, dtype=torch.uint8)
    pages = torch.arange(256) << 20
    stamps, done = [], threading.Event()

    def spin():
        while not done.is_set():
            stamps.append(time.perf_counter())

    t = threading.Thread(target=spin)
    t.start()
    overlapped = False
    try:
        for _ in range(5):
            time.sleep(0.01)
            start = time.perf_counter()
            rowcopy.copy_pages(dst, src, pages, pages, _t(0), _t(0), 1 << 20)
            end = time.perf_counter()
            if any(start < x < end for x in stamps):
                overlapped = True
                break
    finally:
        done.set()
        t.join()
    assert torch.equal(dst, src)
    assert overlapped
