"""Device KV pool and req_to_token: exact geometry and round trips."""
from __future__ import annotations

import pytest
import torch

from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv import MHATokenToKVPool, ReqToTokenTable


def mha_plan(num_pages, page_size, num_layers, num_kv_heads, head_dim, dtype):
    return KVPlan.mha(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      dtype=dtype, page_size=page_size, num_pages=num_pages)


def test_pool_shape_zero_init_and_round_trip():
    pool = MHATokenToKVPool(mha_plan(5, 4, 3, 2, 8, "float32"), "cpu")
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_set_kv_one_call_equals_index_copy(dtype):
    """k and v as the decoder passes them (views of a fused qkv row, rows strided) go through
    one C scatter; other inputs (a dtype to convert, a slot past the pool) keep torch's
    index_copy_ and its checks. Either way the same pool bytes."""
    pools = [MHATokenToKVPool(mha_plan(6, 4, 2, 3, 8, str(dtype)[6:]), "cpu") for _ in range(2)]
    qkv = torch.randn(5, 9 * 8 + 2 * 24).to(dtype)
    k, v = qkv[:, 72:96].view(5, 3, 8), qkv[:, 96:].view(5, 3, 8)
    slots = torch.tensor([4, 23, 9, 10, 5])
    assert pools[0]._scatter_fits(slots, k) and pools[0]._scatter_fits(slots, v)
    pools[0].set_kv(1, slots, k, v)
    pools[1].kv[0, 1].index_copy_(0, slots, k)
    pools[1].kv[1, 1].index_copy_(0, slots, v)
    assert torch.equal(pools[0].kv, pools[1].kv)
    assert not pools[0]._scatter_fits(slots, k.float() if dtype != torch.float32 else k.half())
    assert not pools[0]._scatter_fits(slots, k.transpose(1, 2))     # D not contiguous
    assert not pools[0]._scatter_fits(slots[:4], k)                  # counts differ
    with pytest.raises(IndexError, match="outside the pool"):       # checked before writing
        pools[0].set_kv(0, torch.tensor([0, 1, 2, 3, pools[0].kv.shape[2]]), k, v)
    assert not pools[0].kv[:, 0].any()
    pools[0].set_kv(0, slots, k.double(), v.double())               # converted: index_copy_
    assert torch.equal(pools[0].kv[:, 0], pools[0].kv[:, 1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_plan_bytes_match_the_real_tensor(dtype, page_size):
    """The plan sizes pools from bytes per token; the tensor it allocates must agree."""
    plan = mha_plan(3, page_size, 2, 4, 16, dtype)
    pool = MHATokenToKVPool(plan, "cpu")
    itemsize = pool.kv.element_size()
    assert plan.bytes_per_token == 2 * 4 * 16 * 2 * itemsize
    assert pool.size_bytes == plan.device_pool_bytes == 4 * page_size * plan.bytes_per_token
    one_page_one_layer_k = pool.k(0)[:page_size]
    assert plan.bytes_per_page_per_layer("k") == \
        one_page_one_layer_k.numel() * one_page_one_layer_k.element_size()
    assert mha_plan(1, 16, 30, 3, 64, "float32").bytes_per_token == 30 * 3 * 64 * 2 * 4
    assert pool.geom.bytes_per_page == plan.bytes_per_page  # the host pool's page size


def test_plan_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        mha_plan(0, 1, 1, 1, 1, "float32")


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


def test_slots_of_concatenates_row_prefixes_and_checks_bounds():
    """The decode batch's key slots (kv/csrc/rowcopy.c row_prefixes) equal slicing each row,
    for random rows and lengths, empty ones included; bad rows or lengths raise before any
    write."""
    import random

    t = ReqToTokenTable(num_rows=6, max_context_len=40, device="cpu")
    t.table.random_(0, 1 << 40)
    rng = random.Random(0)
    for _ in range(100):
        n = rng.randint(0, 6)
        rows = [rng.randint(0, 6) for _ in range(n)]
        lens = [rng.randint(0, 40) for _ in range(n)]
        want = (torch.cat([t.table[r, :ln] for r, ln in zip(rows, lens)]) if n
                else torch.empty(0, dtype=torch.int64))
        assert torch.equal(t.slots_of(rows, lens), want)
    with pytest.raises(IndexError, match="outside the table"):
        t.slots_of([7], [3])
    with pytest.raises(IndexError, match="outside the table"):
        t.slots_of([1, 2], [3, 41])
