"""Device <-> host page copies: the `kernel` and `direct` IO backends of HiCache.

Both move whole pages (every token of the page, K and V) addressed by page ids, and work on
device-order views (see layouts.py), so neither has a per-layout code path:

  write_back(device_pages, host_pages)       device -> host, all layers in one pass
  load_layer(layer, host_pages, device_pages) host -> device, one layer (a GPU overlaps
                                              loading layer i+1 with computing layer i)
  load_all(host_pages, device_pages)         host -> device, all layers

`kernel`: batched copies over row-index tensors. A "row" is the largest block contiguous on
its side and in a device-order staging buffer (a page of one layer for the device pool,
layer_first and page_first_direct; one token of one layer for page_first; one head-token-layer
for page_head). Torch on CPU has no fused gather-scatter, and a gather into a temporary
followed by a scatter is two trips through RAM (measured: under half of memcpy), so KernelIO
picks per destination run the cheapest single-pass form and only stages what is left, in
chunks that fit a small (cache-resident) staging buffer. On a GPU that buffer is the device
side of SGLang's staged write-back (gather on the device, one contiguous copy across the bus,
scatter on the host); the same code runs on CPU, CUDA and ROCm, and Triton kernels may
replace it later behind this interface.

`direct`: sorts by host page, merges pages that are adjacent on both sides into runs and
copies each run with one strided copy_ (no index tensors). Only layouts where a page of one
layer is one contiguous block qualify: layer_first and page_first_direct.

Which backend works with which layout is the resolver's table; a pair outside it reaching
here is a programming error and raises ValueError. There is no fallback to another layout.
"""
from __future__ import annotations

import torch

from kvstrata.kv import layouts
from kvstrata.kv.host_pool import HostKVPool

SUPPORTED_LAYOUTS = {
    "kernel": (layouts.LAYER_FIRST, layouts.PAGE_FIRST, layouts.PAGE_HEAD),
    "direct": (layouts.LAYER_FIRST, layouts.PAGE_FIRST_DIRECT),
}
# Staging buffer per backend: small enough to stay in L2/L3 cache between the gather and the
# scatter, large enough that per-chunk Python overhead (~10 torch calls) is a few percent.
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
        L, H, D, P = g.num_layers, g.num_kv_heads, g.head_dim, g.page_size
        if (device_kv.dim() != 5 or device_kv.shape[0] != 2 or device_kv.shape[1] != L
                or tuple(device_kv.shape[3:]) != (H, D) or device_kv.shape[2] % P != 0):
            raise ValueError(f"device KV of shape {tuple(device_kv.shape)} does not match the host "
                             f"pool geometry (2, {L}, pages*{P}, {H}, {D})")
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


def _is_run(pages: torch.Tensor) -> bool:
    """True when the (sorted or not) ids are one ascending run p, p+1, ..."""
    return pages.numel() <= 1 or bool((pages[1:] == pages[:-1] + 1).all())


class _Side:
    """One end of a copy (device pool or host pool) as seen by the kernel backend.

    `flat` views the tensor as rows of `unit` words, the largest block contiguous both here and
    in a device-order staging buffer: P*H*D for the device pool, layer_first and
    page_first_direct, H*D for page_first, D for page_head.
    """

    def __init__(self, words: torch.Tensor, view6: torch.Tensor):
        self.view6 = view6
        self.device = words.device
        self.unit, covered = layouts.row_unit(view6)
        offs, self.page_rows = layouts.unit_offsets(view6, self.unit, covered)
        self.offs = offs.to(self.device)
        self.flat = words.view(-1, self.unit)
        # A run of pages of one (kv, layer) is one contiguous block: a gather can write it
        # directly (layer_first order: the device pool and the layer_first host pool).
        self.runs_contiguous = covered == 3 and view6.stride(2) == self.unit

    def rows(self, pages: torch.Tensor, layers: slice) -> torch.Tensor:
        """Row ids of `pages` in device order (kv, layer, page, token, head)."""
        pages = pages.to(self.device).view(1, 1, -1, 1, 1)
        return (self.offs[:, layers] + pages * self.page_rows).reshape(-1)


class KernelIO(KVIOBackend):
    """Batched index-tensor copies; see the module docstring.

    Pairs are sorted by destination page and split into destination runs. Per run or batch of
    short runs the cheapest single-pass form is used, else one staged chunk at a time:

      source   destination  how
      run      run          one strided copy_ (no index tensor)
      any      run, LF      index_select straight into each (kv, layer) block of the run
      any      any, big     one strided copy_ per page (pages >= PER_PAGE_COPY_BYTES)
      any      run          gather (or strided copy) into staging, strided copy_ out
      any      scattered    gather (or strided copy) into staging, index_copy_ out

    (LF: layer_first order with page-sized rows on both sides.) Measured here (1 thread,
    720 KiB pages): index_select into a contiguous block runs at 0.6-0.9 of memcpy with
    12 KiB rows but index_copy_ only at ~0.4 and both slow down with small rows; a strided
    copy_ per page reaches 0.6-0.8. So the staged scatter is the last resort, kept for small
    pages (where per-call overhead dominates) and for per-layer loads.
    """
    name = "kernel"
    # Destination runs shorter than this are batched with their neighbours (one gather and
    # one scatter per chunk) instead of paying a few torch calls each.
    MIN_RUN = 4
    # From this many bytes per page (over the layers moved), one strided copy_ per page (one
    # pass, ~10 us of overhead) beats staging (two passes, index_copy_ at ~0.4 of memcpy):
    # measured 0.5-0.8 vs 0.4-0.5 of memcpy for 720 KiB pages, 0.24-0.31 vs 0.17-0.19 for
    # 45 KiB pages (SmolLM2, page size 1) on loads, about equal on write-back.
    PER_PAGE_COPY_BYTES = 32 << 10

    def __init__(self, device_kv: torch.Tensor, host_pool: HostKVPool, *,
                 staging_bytes: int = DEFAULT_STAGING_BYTES,
                 per_page_copy_bytes: int | None = None):
        super().__init__(device_kv, host_pool)
        if per_page_copy_bytes is not None:  # tests force either form
            self.PER_PAGE_COPY_BYTES = per_page_copy_bytes
        self.sides = {"device": _Side(self.dev_words, self.dev6),
                      "host": _Side(self.host_words, self.host6)}
        word = self.dev_words.dtype
        self.page_layer_elems = 2 * self.dev6[0, 0, 0].numel()  # K and V of one page, one layer
        elems = max(staging_bytes // self.dev_words.element_size(),
                    self.page_layer_elems * self.num_layers)
        # Device-order staging buffers, per direction (a write-back on the transfer worker may
        # run while the runner loads a layer) and per device involved (one on CPU; on a GPU the
        # host-side gather/scatter runs on CPU and a contiguous buffer crosses the bus).
        self.staging = {}
        for direction in ("d2h", "h2d"):
            bufs = self.staging[direction] = {}
            for device, pin in ((device_kv.device, False),
                                (host_pool.kv.device, host_pool.kv.is_pinned())):
                if device not in bufs:
                    bufs[device] = torch.empty(elems, dtype=word, device=device,
                                               pin_memory=pin and device.type == "cpu")
        self.staging_elems = elems

    def _copy(self, direction, layer, src_ids, dst_ids):
        src, dst = ((self.sides["device"], self.sides["host"]) if direction == "d2h"
                    else (self.sides["host"], self.sides["device"]))
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        num_layers = self.num_layers if layer is None else 1
        cap = max(1, self.staging_elems // (self.page_layer_elems * num_layers))
        stage = self.staging[direction]
        order = torch.argsort(dst_ids)
        src_ids, dst_ids = src_ids[order], dst_ids[order]
        breaks = torch.nonzero(dst_ids[1:] != dst_ids[:-1] + 1).flatten() + 1
        bounds = [0] + breaks.tolist() + [dst_ids.numel()]
        batch_start = None  # start of a pending batch of short destination runs
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b - a >= self.MIN_RUN:
                if batch_start is not None:
                    self._scattered(src, dst, src_ids[batch_start:a], dst_ids[batch_start:a],
                                    layers, num_layers, cap, stage)
                    batch_start = None
                self._dst_run(src, dst, src_ids[a:b], int(dst_ids[a]), layers, num_layers, cap,
                              stage)
            elif batch_start is None:
                batch_start = a
        if batch_start is not None:
            self._scattered(src, dst, src_ids[batch_start:], dst_ids[batch_start:], layers,
                            num_layers, cap, stage)

    def _dst_run(self, src: _Side, dst: _Side, s: torch.Tensor, d0: int, layers: slice,
                 num_layers: int, cap: int, stage: dict) -> None:
        k = s.numel()
        if _is_run(s):
            s0 = int(s[0])
            # Between layouts with different axis orders, copy a cache-sized block of pages at
            # a time: one huge permuted copy_ measured 2x slower (page_head: 0.2 of memcpy).
            step = k if (src.runs_contiguous and dst.runs_contiguous) else cap
            for c in range(0, k, step):
                n = min(step, k - c)
                dst.view6[:, layers, d0 + c:d0 + c + n].copy_(
                    src.view6[:, layers, s0 + c:s0 + c + n])
            return
        if (src.device == dst.device and dst.runs_contiguous and src.runs_contiguous
                and k >= 2 * num_layers):
            # Single pass: each (kv, layer) block of the destination run is contiguous, so one
            # index_select per block gathers the source pages straight into it.
            rows = src.rows(s, layers).view(2, num_layers, k)
            first = layers.start or 0
            for kv in range(2):
                for j in range(num_layers):
                    # view, not reshape: a silent copy would make `out=` write into a temporary
                    out = dst.view6[kv, first + j, d0:d0 + k].view(k, -1)
                    torch.index_select(src.flat, 0, rows[kv, j], out=out)
            return
        if self._per_page(src, dst, num_layers):
            self._page_by_page(src, dst, s, torch.arange(d0, d0 + k), layers)
            return
        for c in range(0, k, cap):
            buf = self._fill(src, dst, s[c:c + cap], layers, num_layers, stage)
            dst.view6[:, layers, d0 + c:d0 + c + buf.shape[2]].copy_(buf)

    def _scattered(self, src: _Side, dst: _Side, s: torch.Tensor, d: torch.Tensor,
                   layers: slice, num_layers: int, cap: int, stage: dict) -> None:
        if self._per_page(src, dst, num_layers):
            self._page_by_page(src, dst, s, d, layers)
            return
        for c in range(0, s.numel(), cap):
            buf = self._fill(src, dst, s[c:c + cap], layers, num_layers, stage)
            dst.flat.index_copy_(0, dst.rows(d[c:c + cap], layers), buf.view(-1, dst.unit))

    def _per_page(self, src: _Side, dst: _Side, num_layers: int) -> bool:
        if src.device != dst.device:
            return False  # across the bus one contiguous staged copy beats many small ones
        page_bytes = self.page_layer_elems * num_layers * self.dev_words.element_size()
        return page_bytes >= self.PER_PAGE_COPY_BYTES

    @staticmethod
    def _page_by_page(src: _Side, dst: _Side, s: torch.Tensor, d: torch.Tensor,
                      layers: slice) -> None:
        for sp, dp in zip(s.tolist(), d.tolist()):
            dst.view6[:, layers, dp].copy_(src.view6[:, layers, sp])

    def _fill(self, src: _Side, dst: _Side, s: torch.Tensor, layers: slice,
              num_layers: int, stage: dict) -> torch.Tensor:
        """Copy source pages `s` into a device-order staging buffer on the destination's
        device, (2, layers, len(s), P, H, Dw)."""
        shape = (2, num_layers, s.numel()) + tuple(self.dev6.shape[3:])
        numel = self.page_layer_elems * num_layers * s.numel()
        buf = stage[src.device][:numel].view(shape)
        if _is_run(s):
            s0 = int(s[0])
            buf.copy_(src.view6[:, layers, s0:s0 + s.numel()])
        else:
            torch.index_select(src.flat, 0, src.rows(s, layers), out=buf.view(-1, src.unit))
        if dst.device != src.device:
            # Blocking on purpose: the next chunk reuses both buffers. Overlapping chunks on a
            # GPU needs double buffering (not written: no GPU to test it on yet).
            other = stage[dst.device][:numel].view(shape)
            other.copy_(buf)
            buf = other
        return buf


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
