"""One-pass scatter-gather of pages between CPU tensors (the C extension `_rowcopy`).

HiCache's `kernel` IO backend moves pages whose bytes are scattered on both sides (random
device pages, a host layout with another axis order). Torch on CPU has no fused
gather-scatter: `index_copy_` into scattered rows measured ~0.5 of memcpy here, and a gather
into a temporary plus a scatter is two trips through RAM. The C loop copies each byte once,
page after page, with non-temporal stores and a software prefetch; see csrc/rowcopy.c.

A page is `rows_per_page` rows of `row_bytes`; row r of page i moves
    dst[dst_pages[i] + dst_rows[r] : +row_bytes] <- src[src_pages[i] + src_rows[r] : ...]
with every offset an int64 *byte* offset from the tensor's first byte. All offsets are
bounds-checked in C before anything moves.
"""
from __future__ import annotations

import torch

from kvstrata.kv import _rowcopy

# Below this many bytes a transfer uses plain memcpy, leaving the destination in cache: small
# loads are read by the very next forward. Above it the data would not fit anyway.
STREAMING_MIN_BYTES = 1 << 20


def _check_offsets(name: str, t: torch.Tensor) -> int:
    if (t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous()
            or t.dim() != 1):
        raise ValueError(f"{name} must be a contiguous 1-D int64 CPU tensor, got {t.dtype} on "
                         f"{t.device}, shape {tuple(t.shape)}")
    return t.data_ptr()


def copy_pages(dst: torch.Tensor, src: torch.Tensor, dst_pages: torch.Tensor,
               src_pages: torch.Tensor, dst_rows: torch.Tensor, src_rows: torch.Tensor,
               row_bytes: int, *, streaming: bool | None = None) -> bool:
    """Copy len(dst_pages) pages of len(dst_rows) rows each (see the module docstring).

    Both tensors must be contiguous and on the CPU (pinned memory is fine). Returns whether
    streaming stores were used: `streaming=None` decides by size; they also need 16-byte
    aligned destination rows.
    """
    for name, t in (("dst", dst), ("src", src)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor, got device {t.device}, "
                             f"contiguous={t.is_contiguous()}")
    addrs = [_check_offsets(name, t) for name, t in (
        ("dst_pages", dst_pages), ("src_pages", src_pages), ("dst_rows", dst_rows),
        ("src_rows", src_rows))]
    if dst_pages.numel() != src_pages.numel() or dst_rows.numel() != src_rows.numel():
        raise ValueError(f"page and row offsets must pair up: {dst_pages.numel()} vs "
                         f"{src_pages.numel()} pages, {dst_rows.numel()} vs {src_rows.numel()} "
                         f"rows")
    n, rows = dst_pages.numel(), dst_rows.numel()
    if streaming is None:
        streaming = n * rows * row_bytes >= STREAMING_MIN_BYTES
    return _rowcopy.copy_pages(dst.data_ptr(), dst.numel() * dst.element_size(),
                               src.data_ptr(), src.numel() * src.element_size(),
                               addrs[0], addrs[1], n, addrs[2], addrs[3], rows, row_bytes,
                               streaming)
