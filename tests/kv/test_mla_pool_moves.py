"""The MLA + DSA-indexer pool moves through the same geometry as MHA: device -> host -> device
round trips in each MLA layout and IO backend, and layout-independent flat pages, carry the
latent AND the indexer keys of every layer bit-exactly."""
from __future__ import annotations

import pytest
import torch

from kvstrata.config.kv_plan import KVPlan, mla_components
from kvstrata.kv.device_pool import MLATokenToKVPool
from kvstrata.kv.host_pool import HostKVPool
from kvstrata.kv.io_backends import make_io_backend
from kvstrata.kv.layouts import KVGeometry

LATENT, INDEX, LAYERS, P = 11, 6, 3, 4


def _plan(layout: str, io: str) -> KVPlan:
    return KVPlan(P, 9, 4, 64, "mla", mla_components(LAYERS, LATENT, "float32", INDEX),
                  num_host_pages=7, host_layout=layout, io_backend=io)


def _fill(pool: MLATokenToKVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        slots = torch.arange(P, pool.num_slots)
        pool.set_latent(layer, slots, torch.randn(len(slots), LATENT, generator=g),
                        torch.randn(len(slots), INDEX, generator=g))


def _page(pool: MLATokenToKVPool, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = slice(page * P, (page + 1) * P)
    return pool.latent[:, s].clone(), pool.index_k[:, s].clone()


@pytest.mark.parametrize("layout,io", [("layer_first", "kernel"), ("page_first", "kernel"),
                                       ("page_first_direct", "direct"),
                                       ("layer_first", "direct")])
def test_round_trip_carries_latent_and_index_keys(layout, io):
    plan = _plan(layout, io)
    geom = KVGeometry.from_plan(plan)
    assert (geom.num_sections, geom.num_kv_heads, geom.head_dim) == (1, 1, LATENT + INDEX)
    assert geom.bytes_per_page == plan.bytes_per_page
    pool = MLATokenToKVPool(plan, "cpu")
    _fill(pool, 1)
    host = HostKVPool.from_plan(plan, check_memory=False)
    backend = make_io_backend(io, pool.kv, host)
    src, host_pages, dst = [3, 5, 1], [6, 2, 3], [7, 8, 9]
    before = [_page(pool, p) for p in src]
    backend.write_back(src, host_pages)
    backend.load_all(host_pages, dst)
    for (lat, idx), page in zip(before, dst):
        got_lat, got_idx = _page(pool, page)
        assert torch.equal(got_lat, lat) and torch.equal(got_idx, idx)
    # Flat pages (the storage tier's layout-independent bytes): latent then index keys of
    # each layer, token by token, whatever the host layout.
    flat = host.get_flat_pages([6])
    lat, idx = before[0]
    expected = torch.cat((lat, idx), dim=-1).reshape(-1)   # (L, P, latent + index)
    assert torch.equal(flat[0], expected)
    host.set_flat_pages([4], flat)
    assert torch.equal(host.get_flat_pages([4]), flat)


def test_pool_views_share_one_tensor():
    plan = _plan("layer_first", "kernel")
    pool = MLATokenToKVPool(plan, "cpu")
    pool.set_latent(1, torch.tensor([5]), torch.ones(1, LATENT), torch.full((1, INDEX), 2.0))
    assert pool.kv[0, 1, 5, 0].tolist() == [1.0] * LATENT + [2.0] * INDEX
    assert pool.size_bytes == plan.device_pool_bytes
