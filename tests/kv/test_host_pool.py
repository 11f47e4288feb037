"""Host KV pool: sizing, the RAM refusal, shapes per layout, flat page helpers."""
from __future__ import annotations

import logging
import pytest
import torch

from kvstrata.config.kv_plan import KVPlan
from kvstrata.config.kv_sizing import host_pool_num_pages
from kvstrata.kv import host_pool as hp
from kvstrata.kv.host_pool import HostKVPool, check_host_memory
from kvstrata.kv.layouts import LAYOUTS, KVGeometry, device_order_view, host_shape

GEOM = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=12, page_size=4, dtype=torch.float32)


def plan_with_host(dtype, num_host_pages, layout, size_flag="--hicache-ratio"):
    """Device pool of 10 pages of 4 tokens (3 layers, 2 heads, head dim 12)."""
    return KVPlan.mha(num_layers=3, num_kv_heads=2, head_dim=12, dtype=dtype, page_size=4,
                      num_pages=10, num_host_pages=num_host_pages, host_layout=layout,
                      io_backend="direct" if layout == "page_first_direct" else "kernel",
                      host_size_flag=size_flag)


def test_bytes_per_token_smollm2():
    g = KVPlan.mha(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", page_size=16,
                   num_pages=1)
    assert g.bytes_per_token == 30 * 3 * 64 * 2 * 4 == 46080
    assert g.bytes_per_page == 16 * 46080
    assert KVPlan.mha(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16",
                      page_size=16, num_pages=1).bytes_per_token == 23040


def test_size_from_ratio_and_from_gb():
    # ratio: 100 device tokens x 2.5 = 250 tokens -> 62 whole pages of 4 (rounded down).
    assert host_pool_num_pages(device_pool_tokens=100, page_size=4, bytes_per_token=576,
                               hicache_ratio=2.5, hicache_size=0) == 62
    # size wins when > 0: 0.001 GB = 1e6 bytes / 576 = 1736 tokens -> 434 pages.
    assert host_pool_num_pages(device_pool_tokens=100, page_size=4, bytes_per_token=576,
                               hicache_ratio=2.5, hicache_size=0.001) == 434
    with pytest.raises(ValueError, match="--hicache-size .* or --hicache-ratio"):
        host_pool_num_pages(device_pool_tokens=100, page_size=4, bytes_per_token=576,
                            hicache_ratio=None, hicache_size=0)
    with pytest.raises(ValueError, match="less than one page.*--hicache-ratio"):
        host_pool_num_pages(device_pool_tokens=1, page_size=4, bytes_per_token=576,
                            hicache_ratio=2.0, hicache_size=0)


def test_smaller_than_device_pool_only_warns(caplog):
    with caplog.at_level(logging.WARNING):
        assert host_pool_num_pages(device_pool_tokens=100, page_size=4, bytes_per_token=576,
                                   hicache_ratio=0.5, hicache_size=0) == 12
    assert "not larger than the device pool" in caplog.text


def test_ram_refusal_names_both_figures_and_the_flag():
    check_host_memory(5 * 10**9, "--hicache-size", available_bytes=8 * 10**9,
                      reserve_bytes=2 * 10**9)  # 5 <= 8 - 2: fine
    with pytest.raises(ValueError) as err:
        check_host_memory(7 * 10**9, "--hicache-size", available_bytes=8 * 10**9,
                          reserve_bytes=2 * 10**9)
    msg = str(err.value)
    assert "needs 7.00 GB" in msg and "only 6.00 GB" in msg and "8.00 GB available" in msg
    assert "2.00 GB reserve" in msg and "Reduce --hicache-size" in msg


def test_pool_refuses_before_allocating(monkeypatch):
    monkeypatch.setattr(hp, "available_ram_bytes", lambda: 10**6)
    with pytest.raises(ValueError, match="Reduce --hicache-ratio"):
        HostKVPool.from_plan(plan_with_host("float32", 1000, "page_first"), reserve_bytes=0)
    with pytest.raises(ValueError, match="Reduce --hicache-size"):
        HostKVPool.from_plan(plan_with_host("float32", 4340, "page_first", "--hicache-size"),
                             reserve_bytes=0)


def test_from_plan_logs_and_touches(caplog):
    plan = plan_with_host("bfloat16", 20, "layer_first")
    with caplog.at_level(logging.INFO, logger="kvstrata.kv.host_pool"):
        pool = HostKVPool.from_plan(plan)
    assert pool.num_pages == 20 and pool.num_tokens == 80
    assert pool.kv.shape == (2, 3, 84, 2, 12)  # 20 pages + the reserved page 0
    assert pool.size_bytes == 21 * 4 * 3 * 2 * 12 * 2 * 2 == pool.kv.numel() * 2
    assert plan.host_pool_bytes == pool.size_bytes
    assert not pool.kv.any()  # zeroed, i.e. touched
    assert "Allocating 0.00 GB host memory" in caplog.text and "layout layer_first" in caplog.text


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shapes_and_device_order(layout):
    pool = HostKVPool(GEOM, 5, layout)
    expect = {"layer_first": (2, 3, 24, 2, 12), "page_first": (2, 24, 3, 2, 12),
              "page_first_direct": (2, 6, 3, 4, 2, 12), "page_head": (2, 6, 2, 4, 3, 12)}
    assert pool.kv.shape == expect[layout] == host_shape(layout, GEOM, 6)
    # Write a recognisable value through the device-order view and find it in natural order.
    view = pool.device_order()
    assert view.shape == (2, 3, 6, 4, 2, 12)
    view[1, 2, 5, 3, 1, 7] = 42.0  # V, layer 2, page 5, token 3 of the page, head 1, dim 7
    where = {"layer_first": (1, 2, 5 * 4 + 3, 1, 7), "page_first": (1, 5 * 4 + 3, 2, 1, 7),
             "page_first_direct": (1, 5, 2, 3, 1, 7), "page_head": (1, 5, 1, 3, 2, 7)}
    assert pool.kv[where[layout]] == 42.0 and pool.kv.sum() == 42.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_pages_are_layout_independent(layout):
    pool = HostKVPool(GEOM, 5, layout)
    flat = torch.randn(2, GEOM.page_numel)
    pool.set_flat_pages([4, 2], flat)
    assert torch.equal(pool.get_flat_pages([2, 4]), flat[[1, 0]])
    assert torch.equal(pool.get_flat_pages([4])[0], flat[0])
    # The flat order is (2, L, P, H, D) whatever the layout.
    ref = flat[0].view(2, 3, 4, 2, 12)
    assert torch.equal(device_order_view(layout, pool.kv, 4)[:, :, 4], ref)
    assert pool.get_flat_pages([1, 3, 5]).abs().sum() == 0  # other pages untouched
    pool.set_flat_pages([1], torch.ones(1, pool.geom.page_numel, dtype=pool.geom.dtype))
    assert pool.get_flat_pages([1])[0].eq(1).all()
    with pytest.raises(ValueError, match="host page ids"):
        pool.get_flat_pages([0])
    with pytest.raises(ValueError, match="expected flat pages"):
        pool.set_flat_pages([1], flat)
