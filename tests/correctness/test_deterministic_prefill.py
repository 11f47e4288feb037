"""Deterministic inference's attention order (torch_native.py `fixed_order`): every query of a
full-attention layer, prompt or decode, in the prefill kernel's order -- prompts in the prefill
kernel (tiles of query rows sharing each key block), decode rows as one-row prompts of it
(paged_decode `fixed`, csrc/decode_fixed.h). A prompt row must equal, bit for bit, the same row
run later as a decode step over keys read back from the pool, whatever the other rows of its
call, its cached prefix, the page layout, GQA and the threads; per dtype and instruction set.
Also run on the emulated AVX-512 bodies (test_emulated_avx512.py)."""
from __future__ import annotations

import random

import pytest
import torch

from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv.device_pool import MHATokenToKVPool
from kvstrata.kv.req_to_token import ReqToTokenTable
from kvstrata.runner.attention import paged_decode as pd
from kvstrata.runner.attention.paged_decode import (paged_decode, prefill_attention,
                                                    prefill_kernel_isa, prefill_seqs)
from kvstrata.runner.attention.torch_native import TorchNativeAttnBackend
from kvstrata.runner.forward_batch import ForwardBatch


def _paged_slots(rng: random.Random, lengths: list[int], page_size: int, pool_pages: int
                 ) -> list[torch.Tensor]:
    """Each request's slots: whole pages handed out shuffled (position p at page * P + p % P),
    as the scheduler places them."""
    pages = list(range(1, pool_pages))
    rng.shuffle(pages)
    out = []
    for n in lengths:
        mine = [pages.pop() for _ in range(-(-n // page_size))]
        out.append(torch.tensor([mine[p // page_size] * page_size + p % page_size
                                 for p in range(n)], dtype=torch.int64))
    return out


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128), (14, 2, 64), (6, 2, 32)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_rows_equal_fixed_decode_rows(monkeypatch, isa, dtype, hq, hkv, d, page_size):
    """Random prompts (random cached prefixes, lengths across the 64-key blocks and 32-row
    query tiles) in one prefill call, q a strided view of a fused qkv projection, on 3
    threads: every row equals the decode kernel's `fixed` order on that row alone (1 thread)
    and beside the other decode rows of a batch; the decode kernel's own order differs (so
    this is not vacuous)."""
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    rng = random.Random(hq * 1000 + d * 10 + page_size)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    prompts = [(rng.randrange(0, 90), rng.randrange(1, 80)) for _ in range(3)]  # (prefix, new)
    pool_pages = 2000 // page_size
    tables = _paged_slots(rng, [p + n for p, n in prompts], page_size, pool_pages)
    rows = pool_pages * page_size
    k_cache = (torch.randn(rows, hkv, d, generator=g) * 2).to(dtype)
    v_cache = torch.randn(rows, hkv, d, generator=g).to(dtype)
    total = sum(n for _, n in prompts)
    qkv = (torch.randn(total, hq * d + 2 * hkv * d, generator=g) * 2).to(dtype)
    q = qkv[:, :hq * d].view(total, hq, d)
    seqs, off, lo = [], 0, 0
    for (prefix, new), table in zip(prompts, tables):
        seqs.append((lo, lo + new, off, prefix))
        off += table.numel()
        lo += new
    scale = d ** -0.5
    together = prefill_attention(q, k_cache, v_cache, torch.cat(tables), prefill_seqs(seqs),
                                 scale, num_threads=3)
    # every row as a decode row: in one batch (3 threads) and some alone (1 thread)
    keys, starts, ends, row = [], [], [], 0
    base = 0
    for (prefix, new), table in zip(prompts, tables):
        keys.append(table)
        starts += [base] * new
        ends += [base + prefix + j + 1 for j in range(new)]
        base += table.numel()
    batch = paged_decode(q, k_cache, v_cache, torch.cat(keys), torch.tensor(starts), scale,
                         num_threads=3, ends=torch.tensor(ends), fixed=True)
    old = paged_decode(q, k_cache, v_cache, torch.cat(keys), torch.tensor(starts), scale,
                       num_threads=3, ends=torch.tensor(ends))
    for i, ((prefix, new), table) in enumerate(zip(prompts, tables)):
        for j in range(new):
            assert torch.equal(together[row], batch[row]), f"prompt {i} row {j} (batch)"
            if j % 7 == 0 or j == new - 1:
                mine = table[:prefix + j + 1].contiguous()
                alone = paged_decode(q[row:row + 1], k_cache, v_cache, mine,
                                     torch.tensor([0, mine.numel()]), scale, num_threads=1,
                                     fixed=True)
                assert torch.equal(together[row], alone[0]), f"prompt {i} row {j} (alone)"
            row += 1
    torch.testing.assert_close(old.float(), together.float(), rtol=0,
                               atol=2e-5 if dtype == torch.float32 else 3e-2)
    if prefill_kernel_isa(d) != "scalar":  # (the scalar bodies may agree by chance)
        assert not torch.equal(old, together), "the decode kernel's order gave the same bits"


def test_fixed_refuses_what_its_order_does_not_cover():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(16, 1, 32, generator=g)
    q = torch.randn(1, 2, 32, generator=g)
    slots, starts = torch.arange(4), torch.tensor([0, 4])
    with pytest.raises(ValueError, match="fixed"):
        paged_decode(q, k.bfloat16(), k.bfloat16(), slots, starts, 1.0, fixed=True)
    with pytest.raises(ValueError, match="fixed"):
        paged_decode(q, k, k, slots, starts, 1.0, fixed=True, softcap=30.0)
    with pytest.raises(ValueError, match="fixed"):
        paged_decode(q, k, k, slots, starts, 1.0, fixed=True,
                     sinks=torch.zeros(2, dtype=torch.float32))


HQ, HKV, D = 9, 3, 64


def _backend(dtype, page_size, windows):
    plan = KVPlan.mha(num_layers=len(windows), num_kv_heads=HKV, head_dim=D,
                      dtype=str(dtype).removeprefix("torch."), page_size=page_size,
                      num_pages=1024 // page_size, num_rows=8, context_len=512)
    return TorchNativeAttnBackend(MHATokenToKVPool(plan, "cpu"), ReqToTokenTable(8, 512, "cpu"),
                                  HQ, HKV, D, page_size=page_size, deterministic=True,
                                  layer_windows=windows)


def _forward(backend, layer_inputs, reqs, slots, lo_hi):
    """One forward of requests (row, start, n) over flat tokens lo_hi[i] of every layer's
    inputs (q, k, v of all tokens): each layer's output rows."""
    fb = ForwardBatch.build([[5] * n for _, _, n in reqs], [r for r, _, _ in reqs],
                            [s for _, s, _ in reqs], torch.device("cpu"),
                            out_slots=torch.cat([slots[r][s:s + n] for r, s, n in reqs]))
    backend.init_forward_metadata(fb)
    idx = torch.cat([torch.arange(a, b) for a, b in lo_hi])
    return fb, [backend.forward(layer, q[idx], k[idx], v[idx], fb)
                for layer, (q, k, v) in enumerate(layer_inputs)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_step_rows_equal_their_decode_steps(monkeypatch, dtype, page_size):
    """A deterministic backend's mixed step -- a fresh prompt, a chunk after a cached prefix, a
    3-token verify entry, decode rows -- over a full layer (the prefill kernel's order) and a
    windowed one (the decode kernel's, its plan never shared with the full one): every token
    equals itself run later as a one-token decode step over the pool, bit for bit (the order
    forced on where fixed_order_pays keeps it off)."""
    monkeypatch.setattr(pd, "fixed_order_pays", lambda *a: True)
    monkeypatch.setenv("KVSTRATA_CPU_DETERMINISTIC_BLOCKS", "1")  # opt-in
    backend = _backend(dtype, page_size, [None, 24])
    assert backend.fixed_order
    rng = random.Random(page_size)
    g = torch.Generator().manual_seed(7)
    reqs = [(1, 0, 41), (2, 30, 17), (3, 50, 3), (4, 70, 1), (5, 12, 1)]  # (row, start, n)
    tables = _paged_slots(rng, [s + n for _, s, n in reqs], page_size, 1024 // page_size)
    slots = {}
    for (row, _, _), table in zip(reqs, tables):
        backend.req_to_token.write(row, 0, table.tolist())
        slots[row] = table
    # every token's q / k / v per layer, flat in request order; cached keys written first
    flat = sum(s + n for _, s, n in reqs)
    layer_inputs = [tuple((torch.randn(flat, h, D, generator=g) * 2).to(dtype)
                          for h in (HQ, HKV, HKV)) for _ in range(2)]
    spans, base = [], 0
    for (row, start, n) in reqs:
        spans.append((base, start, n))
        for layer, (_, k, v) in enumerate(layer_inputs):
            backend.kv_pool.set_kv(layer, slots[row][:start], k[base:base + start],
                                   v[base:base + start])
        base += start + n
    fb, outs = _forward(backend, layer_inputs, reqs, slots,
                        [(b + s, b + s + n) for b, s, n in spans])
    full = fb.attn_meta.by_window[None]
    assert full.prefill is not None and all(p.fixed for p in full.pieces
                                            if p.kind == "kernel")
    assert fb.attn_meta.by_window[24] is not full
    off = 0
    for (row, start, n), (b, _, _) in zip(reqs, spans):
        for j in range(n):
            _, alone = _forward(backend, layer_inputs, [(row, start + j, 1)], slots,
                                [(b + start + j, b + start + j + 1)])
            for layer in range(2):
                assert torch.equal(outs[layer][off + j], alone[layer][0]), (
                    f"layer {layer} request {row} token {j}")
        off += n
