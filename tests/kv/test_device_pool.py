"""Device KV pool and req_to_token: exact geometry and round trips."""
from __future__ import annotations

import pytest
import torch

from kvstrata.kv import MHATokenToKVPool, ReqToTokenTable


def test_pool_shape_zero_init_and_round_trip():
    pool = MHATokenToKVPool(num_pages=5, page_size=4, num_layers=3, num_kv_heads=2,
                            head_dim=8, dtype=torch.float32, device="cpu")
    assert pool.kv.shape == (2, 3, 24, 2, 8)
    assert not pool.kv.any()
    slots = torch.tensor([4, 9, 23])  # first slot of page 1, mid page 2, last slot of page 5
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    pool.set_kv(1, slots, k, v)
    assert torch.equal(pool.k(1)[slots], k) and torch.equal(pool.v(1)[slots], v)
    assert torch.equal(pool.kv[0, 1, slots], k) and torch.equal(pool.kv[1, 1, slots], v)
    assert not pool.kv[:, [0, 2]].any()          # other layers untouched
    assert not pool.kv[:, :, :4].any()           # padding page untouched
    assert pool.kv_layer(1).shape == (2, 24, 2, 8)


def test_bytes_per_token():
    assert MHATokenToKVPool.bytes_per_token(30, 3, 64, torch.float32) == 30 * 3 * 64 * 2 * 4
    assert MHATokenToKVPool.bytes_per_token(2, 4, 16, torch.bfloat16) == 2 * 4 * 16 * 2 * 2
    pool = MHATokenToKVPool(2, 1, 2, 4, 16, torch.bfloat16, "cpu")
    assert pool.size_bytes == 3 * MHATokenToKVPool.bytes_per_token(2, 4, 16, torch.bfloat16)


def test_pool_rejects_empty():
    with pytest.raises(ValueError):
        MHATokenToKVPool(0, 1, 1, 1, 1, torch.float32, "cpu")


def test_req_to_token_writes():
    t = ReqToTokenTable(num_rows=3, max_context_len=10, device="cpu")
    assert t.table.shape == (4, 10) and t.table.dtype == torch.int64
    t.write(2, 3, [7, 8, 9])
    assert t.table[2].tolist() == [0, 0, 0, 7, 8, 9, 0, 0, 0, 0]
    t.write_many([1, 3], [0, 8], [[5, 6], [11, 12]])
    assert t.table[1, :3].tolist() == [5, 6, 0] and t.table[3, 8:].tolist() == [11, 12]
    assert not t.table[0].any()  # reserved row
    with pytest.raises(IndexError):
        t.write(0, 0, [1])
    with pytest.raises(IndexError):
        t.write_many([1], [9], [[1, 2]])
    t.clear(2)
    assert not t.table[2].any()
