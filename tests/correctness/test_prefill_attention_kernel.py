"""The CPU prefill attention kernel (runner/attention/csrc/prefill_attention.h, through
paged_decode.prefill_attention) against torch's causal SDPA over the same K/V (every pool
dtype and instruction set, cached prefixes, many prompts in one call), and the rule that
picks it over SDPA (per ISA, head size, dtype, and AMX's prompt-length limit)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.platform import read_cpu_flags
from kvstrata.runner.attention.paged_decode import prefill_seqs

_HAS_AVX2 = {"avx2", "fma"} <= read_cpu_flags()
_HAS_AVX512 = _HAS_AVX2 and "avx512f" in read_cpu_flags()


def _pooled(k, v, rows, g):
    """k, v [n, Hkv, D] written at random rows of a pool of `rows` slots: (k_cache, v_cache,
    their slots)."""
    n = k.shape[0]
    slots = torch.randperm(rows, generator=g)[:n]
    k_cache = torch.zeros(rows, *k.shape[1:], dtype=k.dtype)
    v_cache = torch.zeros(rows, *v.shape[1:], dtype=v.dtype)
    k_cache[slots], v_cache[slots] = k, v
    return k_cache, v_cache, slots


def _causal_sdpa(q, k, v, prefix, scale):
    """q [n, Hq, D] at positions prefix .. over k/v [prefix + n, Hkv, D], in fp32."""
    n = q.shape[0]
    mask = torch.arange(prefix + n)[None, :] <= torch.arange(prefix, prefix + n)[:, None]
    return F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None], attn_mask=mask, enable_gqa=True,
        scale=scale)[0].transpose(0, 1)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 128), (14, 2, 64), (6, 2, 16),
                                      (8, 2, 96)])
@pytest.mark.parametrize("n,prefix", [(1, 0), (7, 0), (64, 0), (65, 0), (200, 0), (40, 37),
                                      (9, 100)])
def test_prefill_kernel_matches_sdpa(monkeypatch, isa, dtype, hq, hkv, d, n, prefix):
    """Causal attention of a prompt (or a chunk after `prefix` cached tokens): queries read
    in place from a fused qkv projection (rows strided), keys and values from scattered
    rows of a pool, against torch's SDPA on the same values: block edges (64 keys, 32
    queries), GQA groups of 1, 3, 4 and 7 heads (the AVX-512 code takes 4 at a time, the
    AVX2 code 3), the scalar reference, the AVX2 path (head_dim % 32 == 0: a head of 96
    runs it under the AVX-512 cap too) and the AVX-512 path (where the CPU has them; a
    capped or missing ISA runs the next one down), 1 and 3 threads."""
    from kvstrata.runner.attention.paged_decode import prefill_attention, prefill_kernel_isa
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    g = torch.Generator().manual_seed(n * 31 + hq * d + prefix)
    qkv = (torch.randn(n, hq * d + 8, generator=g) * 2).to(dtype)
    q = qkv[:, :hq * d].view(n, hq, d)
    k = (torch.randn(prefix + n, hkv, d, generator=g) * 2).to(dtype)
    v = torch.randn(prefix + n, hkv, d, generator=g).to(dtype)
    k_cache, v_cache, slots = _pooled(k, v, 600, g)
    want = _causal_sdpa(q, k, v, prefix, d ** -0.5)
    ran = prefill_kernel_isa(d)
    want_isa = {"scalar": 0, "avx2": 1, "avx512": 2}
    assert want_isa[ran] <= want_isa[isa]
    if isa != "scalar" and d % 32 == 0 and _HAS_AVX2:
        assert ran == ("avx512" if isa == "avx512" and d % 64 == 0 and _HAS_AVX512 else "avx2")
    for threads in (1, 3):
        got = prefill_attention(q, k_cache, v_cache, slots, prefill_seqs([(0, n, 0, prefix)]),
                                d ** -0.5,
                                num_threads=threads)
        assert got.dtype == dtype and got.shape == q.shape
        if dtype == torch.float32:  # another summation order than SDPA's (exp, blocks)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
        else:  # fp32 inside, one rounding to bf16 at the end
            torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)


def test_prefill_kernel_dispatch_rule(monkeypatch):
    """Where the backend runs the prefill kernel instead of SDPA: where its vector code runs
    (AVX-512 with head_dim % 64 == 0, or AVX2 + FMA with head_dim % 32 == 0), fp32 always,
    bf16 with AMX-BF16 up to AMX_BF16_PREFILL_MAX_TOKENS (flash attention on the tiles wins
    on long prompts); never on the scalar code; KVSTRATA_CPU_PREFILL_ATTENTION=0 turns it off."""
    from kvstrata.runner.attention import paged_decode as pd
    from kvstrata.runner.attention.torch_native import TorchNativeAttnBackend
    cpu = torch.device("cpu")
    assert pd.prefill_kernel_isa(64) == ("avx512" if _HAS_AVX512 else
                                         "avx2" if _HAS_AVX2 else "scalar")
    assert pd.prefill_kernel_isa(96) == ("avx2" if _HAS_AVX2 else "scalar")
    assert pd.prefill_kernel_isa(80) == "scalar"
    vec = _HAS_AVX2
    monkeypatch.setattr(pd, "_cpu_flags", lambda: frozenset({"avx512f"}))
    assert pd.prefill_supported(torch.float32, 64, cpu) == vec
    assert pd.prefill_supported(torch.bfloat16, 128, cpu) == vec
    assert pd.prefill_supported(torch.float32, 96, cpu) == vec
    assert not pd.prefill_supported(torch.float32, 80, cpu)
    assert not pd.prefill_supported(torch.float16, 64, cpu)
    assert pd.prefill_max_tokens(torch.bfloat16) is None
    monkeypatch.setattr(pd, "_cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert pd.prefill_supported(torch.bfloat16, 64, cpu) == vec
    assert pd.prefill_max_tokens(torch.bfloat16) == pd.AMX_BF16_PREFILL_MAX_TOKENS
    assert pd.prefill_max_tokens(torch.float32) is None
    assert pd.prefill_supported(torch.float32, 64, cpu) == vec
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "avx2")
    assert pd.prefill_kernel_isa(64) == ("avx2" if vec else "scalar")
    assert pd.prefill_supported(torch.float32, 64, cpu) == vec
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "scalar")
    assert pd.prefill_kernel_isa(64) == "scalar"
    assert not pd.prefill_supported(torch.float32, 64, cpu)
    monkeypatch.delenv("KVSTRATA_CPU_ISA")

    class Pool:
        kv = torch.zeros(1, dtype=torch.float32)
        geom = type("Geom", (), {"num_layers": 1})  # the backend maps layers to pools
    on = TorchNativeAttnBackend(Pool(), None, 9, 3, 64)
    assert on.use_prefill_kernel == vec
    monkeypatch.setenv("KVSTRATA_CPU_PREFILL_ATTENTION", "0")
    assert not TorchNativeAttnBackend(Pool(), None, 9, 3, 64).use_prefill_kernel


@pytest.mark.skipif(not _HAS_AVX2, reason="the prefill kernel's vector code needs AVX2 + FMA")
def test_amx_bf16_prefill_plan_leaves_long_prompts_to_sdpa(monkeypatch):
    """bf16 on an AMX-BF16 CPU: a step's prompts of up to AMX_BF16_PREFILL_MAX_TOKENS (cached
    prefix included) go to the kernel, longer ones to SDPA; fp32 takes every length."""
    from kvstrata.runner.attention import paged_decode as pd
    from kvstrata.runner.attention.torch_native import Piece, TorchNativeAttnBackend
    monkeypatch.setattr(pd, "_cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    top = pd.AMX_BF16_PREFILL_MAX_TOKENS
    table = torch.arange(4 * 2 * top).view(4, 2 * top)
    pieces = [Piece("fresh", 0, 150, row=0, prefix=0),
              Piece("fresh", 150, 151 + top, row=1, prefix=0),       # top + 1 tokens
              Piece("paged", 151 + top, 201 + top, row=2, prefix=top - 50),  # top in all
              Piece("paged", 201 + top, 251 + top, row=3, prefix=top - 49)]
    for dtype, rows in ((torch.bfloat16, [0, 2]), (torch.float32, [0, 1, 2, 3])):
        class Pool:
            kv = torch.zeros(1, dtype=dtype)
            geom = type("Geom", (), {"num_layers": 1})
        backend = TorchNativeAttnBackend(Pool(), None, 9, 3, 64)
        chosen, slots, _ = backend._prefill_plan(pieces, table, torch.zeros(1))
        assert [p.row for p in chosen] == rows, dtype
        assert len(slots) == sum(p.prefix + p.hi - p.lo for p in chosen)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_prefill_kernel_serves_many_prompts_in_one_call(monkeypatch, isa):
    """A batched prefill's prompts in one call: each attends over its own prefix and
    tokens only, through its own slots; rows between them (other requests' tokens) are
    left alone; slots and rows out of range are refused."""
    from kvstrata.runner.attention.paged_decode import prefill_attention
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    hq, hkv, d, t = 9, 3, 64, 150
    g = torch.Generator().manual_seed(7)
    q = torch.randn(t, hq, d, generator=g).bfloat16()
    spans = [(0, 40, 0), (50, 130, 20), (140, 150, 0), (145, 145, 3)]  # (lo, hi, prefix)
    ks = [torch.randn(p + hi - lo, hkv, d, generator=g).bfloat16() for lo, hi, p in spans]
    vs = [torch.randn(p + hi - lo, hkv, d, generator=g).bfloat16() for lo, hi, p in spans]
    k_cache, v_cache, slots = _pooled(torch.cat(ks), torch.cat(vs), 900, g)
    seqs, off = [], 0
    for (lo, hi, prefix), kk in zip(spans, ks):
        seqs.append((lo, hi, off, prefix))
        off += len(kk)
    out = torch.full((t, hq, d), 7.0, dtype=torch.bfloat16)
    assert prefill_attention(q, k_cache, v_cache, slots, prefill_seqs(seqs), 0.125,
                             out=out) is out
    for (lo, hi, prefix), kk, vv in list(zip(spans, ks, vs))[:3]:
        want = _causal_sdpa(q[lo:hi], kk, vv, prefix, 0.125)
        torch.testing.assert_close(out[lo:hi].float(), want, rtol=8e-3, atol=8e-3)
    assert bool((out[40:50] == 7).all()) and bool((out[130:140] == 7).all())
    with pytest.raises(IndexError, match="out of range"):  # query rows past q
        prefill_attention(q, k_cache, v_cache, slots, prefill_seqs([(0, t + 1, 0, 0)]), 0.125)
    with pytest.raises(IndexError, match="out of range"):  # keys past the slots
        prefill_attention(q, k_cache, v_cache, slots[:10], prefill_seqs([(0, 20, 0, 0)]), 0.125)
    with pytest.raises(IndexError, match="outside the pool"):
        prefill_attention(q, k_cache, v_cache, slots + 900, prefill_seqs([(0, 20, 0, 0)]), 0.125)
    with pytest.raises(ValueError, match="int64"):
        prefill_attention(q, k_cache, v_cache, slots.int(), prefill_seqs([(0, 20, 0, 0)]), 0.125)
