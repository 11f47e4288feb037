"""Sliding windows, attention sinks and logit soft-capping in the torch-native backend, on a
real paged pool, against a dense float64 reference with an explicit mask.

One forward mixes every piece kind: fresh prompts shorter and longer than the window, a
prefix hit whose chunk crosses the window edge (long: paged pieces; short: verify queries
on the decode kernel), decode rows, a draft tree; layers of different windows share the
step. Pools of fp32 and bf16, pages of 1 and 16 (pages handed out shuffled), the kernels on
and off (off = the SDPA paths a GPU takes), deterministic ranges, a draft model's tree step
(explicit key lists) and a no-cache forward. Window W: the query at position p sees
p - W + 1 .. p (transformers' sliding_window_overlay: kv > q - W).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv.device_pool import MHATokenToKVPool
from kvstrata.kv.req_to_token import ReqToTokenTable
from kvstrata.runner.attention import window as win
from kvstrata.runner.attention.torch_native import TorchNativeAttnBackend
from kvstrata.runner.forward_batch import ForwardBatch, apply_trees, tree_ancestors

HQ, HKV, D = 4, 2, 32  # GQA; head_dim 32 runs the prefill kernel's AVX2 code
ATOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@dataclass
class Req:
    start: int                     # cached entries
    n: int                         # new entries this forward
    parents: list[int] | None = None  # a draft tree entry


def visible(r: Req, j: int, window: int | None) -> list[int]:
    """Entry indices (slot order) new token j sees."""
    if r.parents is None:
        p = r.start + j
        return list(range(0 if window is None else max(0, p - window + 1), p + 1))
    anc = tree_ancestors(r.parents)[j]
    p = r.start + len(anc) - 1
    lo = 0 if window is None else max(0, p - window + 1)
    return list(range(lo, r.start)) + [r.start + a for a in anc[-window if window else 0:]]


def ref_attention(q, keys, values, scale, sinks, softcap):
    """One query [Hq, D] over keys / values [L, Hkv, D], float64."""
    g = HQ // HKV
    keys = keys.double().repeat_interleave(g, dim=1)
    values = values.double().repeat_interleave(g, dim=1)
    s = torch.einsum("hd,lhd->hl", q.double(), keys) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    m = s.max(-1, keepdim=True).values
    if sinks is not None:
        m = torch.maximum(m, sinks.double()[:, None])
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sinks.double()[:, None] - m)
    return torch.einsum("hl,lhd->hd", e / den, values)


def make_backend(windows, dtype, page_size, num_pages=160, **kw):
    plan = KVPlan.mha(num_layers=len(windows), num_kv_heads=HKV, head_dim=D,
                      dtype=str(dtype).removeprefix("torch."), page_size=page_size,
                      num_pages=num_pages, num_rows=8, context_len=512)
    pool = MHATokenToKVPool(plan, "cpu")
    table = ReqToTokenTable(8, 512, "cpu")
    return TorchNativeAttnBackend(pool, table, HQ, HKV, D, page_size=page_size,
                                  layer_windows=windows, **kw)


def place(backend, reqs, rng):
    """Rows and slots for every request's entries (pages handed out shuffled)."""
    P = backend.page_size
    pages = list(range(1, backend.kv_pool.num_slots // P))
    rng.shuffle(pages)
    slots = []
    for i, r in enumerate(reqs):
        need = -(-(r.start + r.n) // P)
        mine = [pages.pop() for _ in range(need)]
        s = [mine[e // P] * P + e % P for e in range(r.start + r.n)]
        backend.req_to_token.write(i + 1, 0, s)
        slots.append(torch.tensor(s))
    return slots


def run_step(backend, reqs, dtype, sinks=None, softcap=None, seed=0):
    """Random K/V histories, the cached part written to the pool, one forward over the new
    tokens; every layer's output vs the reference. Returns the outputs."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    slots = place(backend, reqs, rng)
    layers = backend.kv_pool.kv.shape[1]
    hist = [[(torch.randn(r.start + r.n, HKV, D, generator=g).to(dtype),
              torch.randn(r.start + r.n, HKV, D, generator=g).to(dtype)) for r in reqs]
            for _ in range(layers)]
    for layer in range(layers):
        for r, s, (k, v) in zip(reqs, slots, hist[layer]):
            backend.kv_pool.set_kv(layer, s[:r.start], k[:r.start], v[:r.start])
    fb = ForwardBatch.build([[5] * r.n for r in reqs], [i + 1 for i in range(len(reqs))],
                            [r.start for r in reqs], torch.device("cpu"),
                            out_slots=torch.cat([s[r.start:] for r, s in zip(reqs, slots)]))
    apply_trees(fb, {i: r.parents for i, r in enumerate(reqs) if r.parents is not None})
    backend.init_forward_metadata(fb)
    outs = []
    for layer in range(layers):
        q = torch.randn(fb.num_tokens, HQ, D, generator=g).to(dtype)
        k = torch.cat([kk[r.start:] for r, (kk, _) in zip(reqs, hist[layer])])
        v = torch.cat([vv[r.start:] for r, (_, vv) in zip(reqs, hist[layer])])
        out = backend.forward(layer, q, k, v, fb, sinks=sinks, softcap=softcap)
        outs.append(out)
        w = backend.layer_windows[layer] if backend.layer_windows else None
        off = 0
        for r, (kk, vv) in zip(reqs, hist[layer]):
            for j in range(r.n):
                idx = visible(r, j, w)
                want = ref_attention(q[off + j], kk[idx], vv[idx], backend.scale, sinks,
                                     softcap)
                torch.testing.assert_close(
                    out[off + j].view(HQ, D).double(), want, atol=ATOL[dtype], rtol=0,
                    msg=lambda m: f"layer {layer} (window {w}) req {r} token {j}: {m}")
            off += r.n
    return outs


def mixed_batch():
    return [Req(0, 40),                  # fresh, longer than every window
            Req(0, 3),                   # fresh, short
            Req(10, 30),                 # prefix hit, chunk crossing the edge: paged
            Req(13, 4),                  # a verify entry of 4 (decode kernel queries)
            Req(25, 1), Req(2, 1),       # decode rows past / inside the window
            Req(20, 6, parents=[-1, 0, 0, 1, 3, 2])]  # a draft tree


WINDOWS = [(1, 4, 16), (4,), (None, 16, 4)]


@pytest.mark.parametrize("extras", ["plain", "sinks", "softcap", "both"])
@pytest.mark.parametrize("kernels", ["on", "off"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("windows", WINDOWS, ids=lambda w: "-".join(map(str, w)))
def test_every_piece_kind_honours_the_window(windows, dtype, page_size, kernels, extras):
    backend = make_backend(list(windows), dtype, page_size)
    if kernels == "off":  # the SDPA paths (a GPU's; KVSTRATA_CPU_PAGED_DECODE=0)
        backend.use_kernel = backend.use_prefill_kernel = False
    g = torch.Generator().manual_seed(3)
    sinks = torch.randn(HQ, generator=g) * 2 if extras in ("sinks", "both") else None
    softcap = 1.5 if extras in ("softcap", "both") else None
    run_step(backend, mixed_batch(), dtype, sinks, softcap)


@pytest.mark.parametrize("page_size", [1, 16])
def test_long_prompts_and_chunks_cross_several_blocks(page_size):
    """Prompts and chunks longer than a windowed block (FRESH_BLOCK queries): every block
    sees its band's keys, from the previous block's tail."""
    backend = make_backend([4, 16, None], torch.float32, page_size, num_pages=2400 // page_size)
    n = win.FRESH_BLOCK + 37
    run_step(backend, [Req(0, n), Req(100, n), Req(win.FRESH_BLOCK - 3, 20)], torch.float32,
             softcap=3.0)


@pytest.mark.parametrize("extras", ["plain", "sinks", "softcap", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_deterministic_ranges_honour_the_window(monkeypatch, page_size, dtype, extras):
    """Deterministic inference: every query (prompts, chunks, decodes, a draft tree) through
    the paged decode kernel's ranges, sinks and soft-cap in its softmax (never the torch math
    of window.piece_math, whose sums are not batch-invariant)."""
    math = win.piece_math

    def no_kernel_piece_in_math(backend, layer, p, *args):
        assert p.kind != "kernel", "a deterministic kernel piece ran the torch math"
        return math(backend, layer, p, *args)

    monkeypatch.setattr(win, "piece_math", no_kernel_piece_in_math)
    backend = make_backend([4, None, 16], dtype, page_size, deterministic=True,
                           softmax_extras=extras != "plain")
    assert not (backend.fixed_order and extras != "plain")  # extras: the decode kernel's
    g = torch.Generator().manual_seed(7)
    sinks = torch.randn(HQ, generator=g) * 2 if extras in ("sinks", "both") else None
    softcap = 1.5 if extras in ("softcap", "both") else None
    run_step(backend, mixed_batch(), dtype, sinks, softcap)


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_draft_tree_step_keys_are_cut_to_the_window(kernels):
    """A draft model's tree step (fb.query_keys: one key per position, its own last): each
    query sees the last W of its keys."""
    backend = make_backend([3, None], torch.float32, 1, num_pages=300)
    backend.use_kernel = kernels == "on"
    g = torch.Generator().manual_seed(5)
    pool = backend.kv_pool
    ctx = torch.arange(1, 12)
    scratch = torch.arange(200, 206)
    keys = [torch.cat([ctx, scratch[:1 + j % 3], scratch[3 + j:4 + j]]) for j in range(3)]
    for layer in range(2):
        pool.set_kv(layer, torch.arange(1, 210), torch.randn(209, HKV, D, generator=g),
                    torch.randn(209, HKV, D, generator=g))
    fb = ForwardBatch.build([[5, 6, 7]], [1], [0], torch.device("cpu"),
                            out_slots=scratch[3:6].clone())
    fb.query_keys = keys
    backend.init_forward_metadata(fb)
    for layer, w in enumerate((3, None)):
        q = torch.randn(3, HQ, D, generator=g)
        k, v = torch.randn(3, HKV, D, generator=g), torch.randn(3, HKV, D, generator=g)
        sinks = torch.randn(HQ, generator=g)
        for s in (None, sinks):
            out = backend.forward(layer, q, k, v, fb, sinks=s)
            for j, key in enumerate(keys):
                key = key if w is None else key[-w:]
                want = ref_attention(q[j], pool.k(layer)[key], pool.v(layer)[key],
                                     backend.scale, s, None)
                torch.testing.assert_close(out[j].view(HQ, D).double(), want, atol=2e-5,
                                           rtol=0)


def test_no_cache_forward_honours_the_window():
    """No pool (out_slots None: a one-request forward over its own tokens)."""
    backend = TorchNativeAttnBackend(None, None, HQ, HKV, D, layer_windows=[5])
    g = torch.Generator().manual_seed(9)
    n = 23
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
    fb = ForwardBatch.build([[5] * n], [0], [0], torch.device("cpu"))
    backend.init_forward_metadata(fb)
    for softcap in (None, 2.0):
        out = backend.forward(0, q, k, v, fb, softcap=softcap)
        for j in range(n):
            idx = list(range(max(0, j - 4), j + 1))
            want = ref_attention(q[j], k[idx], v[idx], backend.scale, None, softcap)
            torch.testing.assert_close(out[j].view(HQ, D).double(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_full_attention_is_unchanged(page_size):
    """No windows (no list, all None, or windows no query reaches past): one plan, the same
    pieces, bit-identical outputs."""
    reqs = mixed_batch()
    base = run_step(make_backend([None] * 3, torch.float32, page_size), reqs, torch.float32)
    assert make_backend([None] * 3, torch.float32, page_size).layer_windows is None
    wide = make_backend([64, None, 1000], torch.float32, page_size)
    for a, b in zip(base, run_step(wide, reqs, torch.float32)):
        assert torch.equal(a, b)


def test_plans_are_built_once_per_window():
    backend = make_backend([4, None, 4, 16, None], torch.float32, 1)
    reqs = [Req(0, 20), Req(30, 1)]
    slots = place(backend, reqs, random.Random(0))
    fb = ForwardBatch.build([[5] * 20, [5]], [1, 2], [0, 30], torch.device("cpu"),
                            out_slots=torch.cat([slots[0], slots[1][30:]]))
    backend.init_forward_metadata(fb)
    plans = fb.attn_meta.by_window
    assert set(plans) == {4, None, 16} and len({id(m) for m in plans.values()}) == 3
    assert not fb.attn_meta.uniform and fb.attn_meta is plans[4]
    assert plans[None].prefill is not None or not backend.use_prefill_kernel
    assert plans[4].prefill is None  # the causal prefill kernel never runs a windowed piece
    kernel = [p for p in plans[4].pieces if p.kind == "kernel"][0]
    assert kernel.slots.tolist() == slots[1][27:31].tolist()  # the decode row's last 4 keys


def test_bad_windows_are_refused():
    for bad in ([0], [-3], [2.5], [True]):
        with pytest.raises(ValueError, match="sliding window"):
            win.normalise_windows(bad)
    assert win.normalise_windows([None, None]) is None
