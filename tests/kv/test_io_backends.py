"""IO backends: device -> host -> device round trips, bit-exact, for every valid layout x IO.

Geometry uses odd sizes (3 layers, 2 heads, head dim 12) so a swapped axis cannot hide, and
a tiny staging buffer so the kernel backend runs many chunks (the chunk boundary is where an
off-by-one would live). Page ids are unsorted, non-contiguous and include adjacent runs
(direct merges those) and runs adjacent on one side only.
"""
from __future__ import annotations

import pytest
import torch

from kvstrata.kv import rowcopy
from kvstrata.kv.host_pool import HostKVPool
from kvstrata.kv.io_backends import SUPPORTED_LAYOUTS, DirectIO, make_io_backend
from kvstrata.kv.layouts import LAYOUTS, KVGeometry

L, H, D = 3, 2, 12
DEVICE_PAGES, HOST_PAGES = 24, 30
# (device ids, host ids, device ids to load back into), paired by position. Each pattern
# drives different copy forms: "mixed" has pages adjacent on both sides (5,6,7 -> 10,11,12),
# on one side only (20,21 -> 3,9), reversed (15,14 -> 25,26) and the last pages; "dst_runs"
# writes scattered device pages into one host run and loads one host run into one device run;
# "src_runs" writes one device run into scattered host pages and loads them into a device run.
PATTERNS = {
    "mixed": ([5, 6, 7, 20, 21, 15, 14, 1, 24, 9], [10, 11, 12, 3, 9, 25, 26, 30, 1, 17],
              [2, 3, 4, 8, 22, 23, 16, 18, 19, 11]),
    "dst_runs": ([9, 3, 17, 5, 11, 2, 20, 14, 7, 12, 1, 19], list(range(4, 16)),
                 list(range(10, 22))),
    "src_runs": (list(range(3, 15)), [15, 4, 9, 22, 6, 11, 30, 2, 18, 13, 25, 8],
                 list(range(10, 22))),
}
DEV_IDS, HOST_IDS, LOAD_IDS = PATTERNS["mixed"]

PAIRS = [(io, layout) for io, layouts in SUPPORTED_LAYOUTS.items() for layout in layouts]
# Kernel runs twice: the CPU form (one native row copy) and the two-device staged form.
VARIANTS = [(io, layout, staged) for io, layout in PAIRS
            for staged in ((False, True) if io == "kernel" else (False,))]


def _random_kv(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # Random bits, not randn: every bit pattern (NaN payloads, -0.0) must survive the copy.
    bits = torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int16)
    if dtype.itemsize == 2:
        return bits.view(dtype)
    return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int32).view(dtype)


def _setup(io, layout, page_size, dtype, staging_bytes=1024, staged=False):
    geom = KVGeometry(L, H, D, page_size, dtype)
    device_kv = _random_kv((2, L, (DEVICE_PAGES + 1) * page_size, H, D), dtype, seed=1)
    host = HostKVPool(geom, HOST_PAGES, layout)
    host.kv.copy_(_random_kv(host.kv.shape, dtype, seed=2))
    kwargs = {"staging_bytes": staging_bytes} if io == "kernel" else {}
    backend = make_io_backend(io, device_kv, host, **kwargs)
    if staged:
        _simulate_two_devices(backend)
    return device_kv, host, backend


def _simulate_two_devices(backend):
    """Run KernelIO's GPU shape on CPU: stage through buffers on both sides in small chunks,
    with torch index ops on the device side (as on a GPU) and the native copy on the host."""
    backend.staged = True
    backend.make_staging()
    backend.sides["device"].native = False


def _pages(t, page_size):  # device KV as (2, L, pages, P, H, D)
    return t.view(2, L, -1, page_size, H, D)


def _same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("io,layout,staged", VARIANTS)
def test_round_trip_bit_exact(io, layout, staged, page_size, dtype, pattern, streaming,
                              monkeypatch):
    # Test transfers are tiny: force the native copy's streaming stores on (where rows are
    # 16-byte aligned) or off regardless of size.
    monkeypatch.setattr(rowcopy, "STREAMING_MIN_BYTES", 0 if streaming else 1 << 62)
    dev_ids, host_ids, load_ids = PATTERNS[pattern]
    device_kv, host, backend = _setup(io, layout, page_size, dtype, staged=staged)
    dev_before, host_before = device_kv.clone(), host.kv.clone()
    backend.write_back(dev_ids, host_ids)

    assert _same_bits(device_kv, dev_before)  # the source is never written
    ref_host = _layout_ref(host, host_before).clone()
    for d, h in zip(dev_ids, host_ids):
        ref_host[:, :, h] = _pages(dev_before, page_size)[:, :, d]
    # Written pages are right and every other host page is unchanged.
    assert _same_bits(host.device_order(), ref_host)

    # Load back: half by load_layer (layer by layer), the rest by load_all.
    half = len(host_ids) // 2
    for layer in range(L):
        backend.load_layer(layer, host_ids[:half], load_ids[:half])
    backend.load_all(host_ids[half:], load_ids[half:])
    expect = _pages(dev_before.clone(), page_size)
    for d, d2 in zip(dev_ids, load_ids):
        expect[:, :, d2] = _pages(dev_before, page_size)[:, :, d]
    assert _same_bits(_pages(device_kv, page_size), expect)


def _layout_ref(host, natural):
    """Device-order view of a natural-layout tensor of the same pool (the pre-write host)."""
    from kvstrata.kv.layouts import device_order_view
    return device_order_view(host.layout, natural, host.page_size)


@pytest.mark.parametrize("io,layout,staged", VARIANTS)
def test_load_layer_touches_only_that_layer(io, layout, staged):
    device_kv, host, backend = _setup(io, layout, 4, torch.float32, staged=staged)
    before = device_kv.clone()
    backend.load_layer(1, [3, 4], [7, 2])
    changed = (device_kv.view(torch.int32) != before.view(torch.int32)).view(2, L, -1).any(dim=2)
    assert not changed[:, 0].any() and not changed[:, 2].any()
    expect = _layout_ref(host, host.kv)[:, 1, [3, 4]]
    assert _same_bits(_pages(device_kv, 4)[:, 1, [7, 2]], expect)


def test_large_staging_buffer_and_empty_transfer():
    device_kv, host, backend = _setup("kernel", "page_first", 16, torch.float32,
                                      staging_bytes=64 << 20)
    backend.write_back([], [])
    backend.write_back(DEV_IDS, HOST_IDS)
    ref = _pages(device_kv, 16)[:, :, DEV_IDS]
    assert _same_bits(host.device_order()[:, :, HOST_IDS], ref)


@pytest.mark.parametrize("io,layout", [(io, layout) for io in SUPPORTED_LAYOUTS
                                       for layout in LAYOUTS
                                       if layout not in SUPPORTED_LAYOUTS[io]])
def test_unsupported_pairs_raise(io, layout):
    with pytest.raises(ValueError, match="does not support host layout"):
        _setup(io, layout, 4, torch.float32)


def test_unknown_backend_and_bad_arguments():
    device_kv, host, backend = _setup("kernel", "layer_first", 4, torch.float32)
    with pytest.raises(ValueError, match="unknown HiCache IO backend"):
        make_io_backend("kernel_ascend", device_kv, host)
    with pytest.raises(ValueError, match="device pages but"):
        backend.write_back([1, 2], [3])
    with pytest.raises(ValueError, match="device page ids"):
        backend.write_back([0], [3])  # page 0 is the padding sink
    with pytest.raises(ValueError, match="host page ids"):
        backend.write_back([1], [HOST_PAGES + 1])
    with pytest.raises(ValueError, match="duplicates"):
        backend.write_back([1, 2], [3, 3])
    with pytest.raises(ValueError, match="does not match"):
        make_io_backend("kernel", device_kv[:, :2].contiguous(), host)
    with pytest.raises(ValueError, match="contiguous"):
        make_io_backend("kernel", device_kv.to(torch.bfloat16), host)


def test_direct_runs_merge_adjacent_pages():
    host = torch.tensor([11, 10, 12, 3, 9, 4])
    dev = torch.tensor([6, 5, 7, 20, 21, 30])
    # Sorted by host: 3->20, 4->30 (device not adjacent), 9->21, 10..12 -> 5..7 (one run).
    assert DirectIO.runs(host, dev) == [(3, 20, 1), (4, 30, 1), (9, 21, 1), (10, 5, 3)]
    assert DirectIO.runs(torch.tensor([], dtype=torch.long),
                         torch.tensor([], dtype=torch.long)) == []
