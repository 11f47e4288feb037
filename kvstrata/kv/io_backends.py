"""Device <-> host page copies: the `kernel` and `direct` IO backends of HiCache.

Both move whole pages (every token of the page, K and V) addressed by page ids, and work on
device-order views (see layouts.py), so neither has a per-layout code path:

  write_back(device_pages, host_pages)       device -> host, all layers in one pass
  load_layer(layer, host_pages, device_pages) host -> device, one layer (a GPU overlaps
                                              loading layer i+1 with computing layer i)
  load_all(host_pages, device_pages)         host -> device, all layers

`kernel`: one gather-scatter per transfer over row indices, every layer at once for
write-back and per layer for loads. On CPU both pools are RAM and the copy is the native row
copy (rowcopy.py: each byte read and written once, streaming stores; torch's index_copy_
into scattered rows measured ~0.5 of memcpy here, the native copy ~1.0). With the device
pool on a GPU the copy is staged, as SGLang stages page_first write-back: gather into a
staging buffer on the source device, one contiguous copy across the bus, scatter on the
other side. The same code serves every layout; Triton kernels may replace the GPU-side
gather/scatter later behind this interface.

`direct`: sorts by host page, merges pages that are adjacent on both sides into runs and
copies each run with one strided copy_ (no index tensors). Only layouts where a page of one
layer is one contiguous block qualify: layer_first and page_first_direct.

Which backend works with which layout is one table (config/kv_plan.py, read by the resolver
and the plan too); a pair outside it reaching here is a programming error and raises
ValueError. There is no fallback to another layout.
"""
from __future__ import annotations

import torch

from kvstrata.config.kv_plan import IO_BACKEND_LAYOUTS
from kvstrata.kv import layouts, rowcopy
from kvstrata.kv.host_pool import HostKVPool

# Which layouts each backend moves: one table, kept with the KV plan (config/kv_plan.py).
SUPPORTED_LAYOUTS = IO_BACKEND_LAYOUTS
# Staging buffer per direction and side when the pools are on two devices: large enough that
# per-chunk overhead (three calls and a bus round trip) is a few percent.
DEFAULT_STAGING_BYTES = 4 << 20


def _as_ids(pages) -> torch.Tensor:
    # Ids live on CPU: run detection and sorting are host-side decisions.
    return torch.as_tensor(pages, dtype=torch.long).reshape(-1).cpu()


class KVIOBackend:
    """Common checks and views; subclasses implement `_copy(direction, layer, src, dst)`.

    Thread safety: one write-back and one load may run at the same time (the transfer
    worker writing while the runner loads a layer); two calls in the same direction must not.
    """
    name = ""

    def __init__(self, device_kv: torch.Tensor, host_pool: HostKVPool):
        if host_pool.layout not in SUPPORTED_LAYOUTS.get(self.name, ()):
            raise ValueError(
                f"IO backend {self.name!r} does not support host layout {host_pool.layout!r} "
                f"(supported: {', '.join(SUPPORTED_LAYOUTS.get(self.name, ()))}); the resolver "
                f"should have rejected or rewritten this combination")
        g = host_pool.geom
        L, H, D, P, C = g.num_layers, g.num_kv_heads, g.head_dim, g.page_size, g.num_sections
        if (device_kv.dim() != 5 or device_kv.shape[0] != C or device_kv.shape[1] != L
                or tuple(device_kv.shape[3:]) != (H, D) or device_kv.shape[2] % P != 0):
            raise ValueError(f"device KV of shape {tuple(device_kv.shape)} does not match the host "
                             f"pool geometry ({C}, {L}, pages*{P}, {H}, {D})")
        if device_kv.dtype != g.dtype or not device_kv.is_contiguous():
            raise ValueError(f"device KV must be a contiguous {g.dtype} tensor, got "
                             f"{device_kv.dtype}, contiguous={device_kv.is_contiguous()}")
        self.host_pool = host_pool
        self.device_kv = device_kv
        self.num_layers = L
        self.device_num_pages = device_kv.shape[2] // P - 1
        # Wide-word views of both sides in device order (2, L, pages, P, H, Dw).
        self.dev_words = layouts.as_words(device_kv)
        self.host_words = layouts.as_words(host_pool.kv)
        self.dev6 = layouts.device_order_view(layouts.LAYER_FIRST, self.dev_words, P)
        self.host6 = layouts.device_order_view(host_pool.layout, self.host_words, P)

    # ---- public verbs ------------------------------------------------------------------------
    def write_back(self, device_pages, host_pages) -> None:
        """Copy device pages to host pages (same order), all layers."""
        dev, host = self._check(device_pages, host_pages, dst_is_host=True)
        self._copy("d2h", None, dev, host)

    def load_layer(self, layer: int, host_pages, device_pages) -> None:
        """Copy one layer of host pages into device pages (same order)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        dev, host = self._check(device_pages, host_pages, dst_is_host=False)
        self._copy("h2d", layer, host, dev)

    def load_all(self, host_pages, device_pages) -> None:
        """Copy every layer of host pages into device pages (same order)."""
        dev, host = self._check(device_pages, host_pages, dst_is_host=False)
        self._copy("h2d", None, host, dev)

    # ---- helpers -----------------------------------------------------------------------------
    def _check(self, device_pages, host_pages, dst_is_host: bool):
        dev, host = _as_ids(device_pages), _as_ids(host_pages)
        if dev.numel() != host.numel():
            raise ValueError(f"{dev.numel()} device pages but {host.numel()} host pages")
        if dev.numel() and (int(dev.min()) < 1 or int(dev.max()) > self.device_num_pages):
            raise ValueError(f"device page ids must be in 1..{self.device_num_pages}, got "
                             f"{int(dev.min())}..{int(dev.max())}")
        self.host_pool.check_page_ids(host)
        dst = host if dst_is_host else dev
        # Two sources scattered to one destination page would leave it undefined.
        if dst.numel() != torch.unique(dst).numel():
            raise ValueError("destination page ids contain duplicates")
        return dev, host

    def _copy(self, direction: str, layer: int | None, src: torch.Tensor,
              dst: torch.Tensor) -> None:
        raise NotImplementedError


AXES = ("kv", "layer", "page", "token", "head")  # device order, the head dim D aside


def _outer_sum(terms: dict[str, torch.Tensor], axes) -> torch.Tensor:
    """Byte offsets of every combination of `axes` (first axis slowest)."""
    out = torch.zeros(1, dtype=torch.long)
    for axis in axes:
        out = (out.view(-1, 1) + terms[axis].view(1, -1)).reshape(-1)
    return out.contiguous()


class _Side:
    """One end of a copy (device pool, host pool) as rows of the backend's row unit.

    A row's byte offset is a sum of one term per axis (kv, layer, page, token, head); axes
    the row unit covers have the single term 0. `order` lists the axes by stride, largest
    first: this side's memory order.
    """

    def __init__(self, words: torch.Tensor, view6: torch.Tensor, unit: int, covered: int):
        self.words = words
        self.device = words.device
        # CPU memory is copied by the native page copy; a GPU side by torch index ops.
        self.native = words.device.type == "cpu"
        self.unit = unit
        self.row_bytes = unit * words.element_size()
        two, L, _, P, H, _ = view6.shape
        strides = dict(zip(AXES, (s * words.element_size() for s in view6.stride()[:5])))
        sizes = {"kv": two, "layer": L, "token": P if covered < 3 else 1,
                 "head": H if covered < 2 else 1}
        self.fixed = {axis: torch.arange(size) * strides[axis] for axis, size in sizes.items()}
        # Row ids (the torch path divides byte offsets by row_bytes) need every stride a
        # whole number of rows; row_unit guarantees it for the layouts we have.
        if any(strides[a] % self.row_bytes for a in AXES if sizes.get(a, 2) > 1):
            raise AssertionError(f"row unit {unit} does not tile the view (strides "
                                 f"{view6.stride()})")
        self.page_stride = strides["page"]
        self.order = sorted(AXES, key=lambda axis: -strides[axis] * (sizes.get(axis, 2) > 1))

    def offsets(self, pages: torch.Tensor, layers: slice, outer_axes, inner_axes):
        """(outer, inner) byte offsets of the rows of `pages` (see the native copy)."""
        terms = dict(self.fixed, layer=self.fixed["layer"][layers], page=pages * self.page_stride)
        return _outer_sum(terms, outer_axes), _outer_sum(terms, inner_axes)

    def gather(self, outer: torch.Tensor, inner: torch.Tensor, buf: torch.Tensor) -> None:
        """Rows at `outer` + `inner` into a contiguous buffer on this side's device, in order."""
        if self.native:
            b_outer, b_inner = _contiguous(outer, inner, self.row_bytes)
            rowcopy.copy_pages(buf, self.words, b_outer, outer, b_inner, inner, self.row_bytes)
        else:
            torch.index_select(self.flat, 0, self._row_ids(outer, inner),
                               out=buf.view(-1, self.unit))

    def scatter(self, outer: torch.Tensor, inner: torch.Tensor, buf: torch.Tensor) -> None:
        """A contiguous buffer on this side's device into the rows at `outer` + `inner`."""
        if self.native:
            b_outer, b_inner = _contiguous(outer, inner, self.row_bytes)
            rowcopy.copy_pages(self.words, buf, outer, b_outer, inner, b_inner, self.row_bytes)
        else:
            self.flat.index_copy_(0, self._row_ids(outer, inner), buf.view(-1, self.unit))

    @property
    def flat(self) -> torch.Tensor:
        return self.words.view(-1, self.unit)

    def _row_ids(self, outer: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
        return ((outer.view(-1, 1) + inner.view(1, -1)).reshape(-1)
                // self.row_bytes).to(self.device)


def _contiguous(outer: torch.Tensor, inner: torch.Tensor, row_bytes: int):
    """Outer/inner offsets of the same rows packed back to back (a staging buffer)."""
    return (torch.arange(outer.numel()) * (inner.numel() * row_bytes),
            torch.arange(inner.numel()) * row_bytes)


class KernelIO(KVIOBackend):
    """One gather-scatter per transfer over row offsets; see the module docstring.

    A row is the largest trailing (P, H, D) block contiguous on both sides in device order:
    a page of one layer (layer_first), one token of one layer (page_first), one head of one
    token of one layer (page_head). Rows are visited in the *source's* memory order, split
    after the page axis into an outer list and a per-page inner pattern (the native copy's
    two-level offsets). Source order keeps reads sequential for the hardware prefetcher while
    streaming stores do not mind scattered writes: measured 0.9-1.4 of memcpy, against
    0.4-0.7 for other orders (benchmarks/bench_transfer.py, 256 pages of 720 KiB).

    Both pools in RAM (CPU): one native copy per transfer (per layer for load_layer), each
    byte read and written once. Pools on two devices (CUDA/ROCm): staged in chunks of pages,
    as SGLang stages page_first write-back: gather on the source device into a staging buffer,
    one contiguous copy across the bus, scatter on the destination; the host-side
    gather/scatter is the native copy into pinned staging.
    """
    name = "kernel"

    def __init__(self, device_kv: torch.Tensor, host_pool: HostKVPool, *,
                 staging_bytes: int = DEFAULT_STAGING_BYTES):
        super().__init__(device_kv, host_pool)
        unit, covered = layouts.row_unit(self.dev6, self.host6)
        self.sides = {"device": _Side(self.dev_words, self.dev6, unit, covered),
                      "host": _Side(self.host_words, self.host6, unit, covered)}
        self.row_bytes = self.sides["device"].row_bytes
        # Every section (K and V; MLA: the one latent+indexer row) of one page, one layer.
        self.page_layer_elems = self.dev6.shape[0] * self.dev6[0, 0, 0].numel()
        self.staging_elems = max(staging_bytes // self.dev_words.element_size(),
                                 self.page_layer_elems * self.num_layers)
        self.staging: dict[str, dict[str, torch.Tensor]] = {}
        self.staged = device_kv.device != host_pool.kv.device
        if self.staged:
            self.make_staging()

    def make_staging(self) -> None:
        """Staging buffers per direction (a write-back on the transfer worker may run while
        the runner loads a layer), one on each side (the host one pinned when the host pool
        is)."""
        word = self.dev_words.dtype
        pin = self.host_pool.kv.is_pinned()
        for direction in ("d2h", "h2d"):
            self.staging[direction] = {
                name: torch.empty(self.staging_elems, dtype=word, device=side.device,
                                  pin_memory=pin and side.device.type == "cpu")
                for name, side in self.sides.items()}

    def _copy(self, direction, layer, src_ids, dst_ids):
        src_name, dst_name = ("device", "host") if direction == "d2h" else ("host", "device")
        src, dst = self.sides[src_name], self.sides[dst_name]
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        cut = src.order.index("page") + 1
        outer_axes, inner_axes = src.order[:cut], src.order[cut:]
        if not self.staged:
            s_outer, s_inner = src.offsets(src_ids, layers, outer_axes, inner_axes)
            d_outer, d_inner = dst.offsets(dst_ids, layers, outer_axes, inner_axes)
            rowcopy.copy_pages(dst.words, src.words, d_outer, s_outer, d_inner, s_inner,
                               self.row_bytes)
            return
        num_layers = self.num_layers if layer is None else 1
        cap = max(1, self.staging_elems // (self.page_layer_elems * num_layers))
        stage = self.staging[direction]
        for c in range(0, src_ids.numel(), cap):
            s_outer, s_inner = src.offsets(src_ids[c:c + cap], layers, outer_axes, inner_axes)
            d_outer, d_inner = dst.offsets(dst_ids[c:c + cap], layers, outer_axes, inner_axes)
            numel = s_outer.numel() * s_inner.numel() * src.unit
            src_buf, dst_buf = stage[src_name][:numel], stage[dst_name][:numel]
            src.gather(s_outer, s_inner, src_buf)
            # Blocking on purpose: the next chunk reuses both buffers. Overlapping chunks on a
            # GPU needs double buffering (not written: no GPU to test it on yet).
            dst_buf.copy_(src_buf)
            dst.scatter(d_outer, d_inner, dst_buf)


class DirectIO(KVIOBackend):
    name = "direct"

    def __init__(self, device_kv: torch.Tensor, host_pool: HostKVPool, *,
                 staging_bytes: int | None = None):
        # staging_bytes is accepted so callers configure both backends alike; runs are copied
        # straight from source to destination, without staging.
        super().__init__(device_kv, host_pool)

    @staticmethod
    def runs(host: torch.Tensor, dev: torch.Tensor) -> list[tuple[int, int, int]]:
        """(host_start, device_start, length) runs of pages adjacent on both sides, in host
        order; sorting by host page first lets adjacent host pages merge even when the caller
        listed them out of order."""
        if host.numel() == 0:
            return []
        order = torch.argsort(host)
        host, dev = host[order], dev[order]
        brk = (host[1:] != host[:-1] + 1) | (dev[1:] != dev[:-1] + 1)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(brk).flatten() + 1])
        ends = torch.cat([starts[1:], torch.tensor([host.numel()])])
        return [(h, d, e - s) for h, d, s, e in zip(host[starts].tolist(), dev[starts].tolist(),
                                                      starts.tolist(), ends.tolist())]

    def _copy(self, direction, layer, src, dst):
        if direction == "d2h":
            pairs = self.runs(dst, src)
            for h, d, n in pairs:
                self.host6[:, :, h:h + n].copy_(self.dev6[:, :, d:d + n])
            return
        sel = slice(None) if layer is None else layer
        for h, d, n in self.runs(src, dst):
            self.dev6[:, sel, d:d + n].copy_(self.host6[:, sel, h:h + n])


IO_BACKENDS = {"kernel": KernelIO, "direct": DirectIO}


def make_io_backend(name: str, device_kv: torch.Tensor, host_pool: HostKVPool,
                    **kwargs) -> KVIOBackend:
    if name not in IO_BACKENDS:
        raise ValueError(f"unknown HiCache IO backend {name!r}; expected one of "
                         f"{', '.join(IO_BACKENDS)}")
    return IO_BACKENDS[name](device_kv, host_pool, **kwargs)
