"""The CPU paged decode kernel (runner/attention/paged_decode.py) against torch SDPA over the
same K/V gathered by hand (every pool dtype, every instruction set this CPU has), and the
attention backend with the kernel on vs off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.runner.attention import _paged_decode
from kvstrata.runner.attention.paged_decode import (KV_DTYPES, DecodeCall, kernel_isa,
                                                   paged_decode, prefill_seqs)


def _reference(q, k_cache, v_cache, slots, starts, scale):
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = []
    for b in range(n):
        idx = slots[starts[b]:starts[b + 1]]
        k = k_cache[idx].float().transpose(0, 1)                          # [Hkv, S, D]
        v = v_cache[idx].float().transpose(0, 1)
        qb = q[b].view(hkv, hq // hkv, d)
        out.append(F.scaled_dot_product_attention(qb, k, v, scale=scale).reshape(hq, d))
    return torch.stack(out)


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 20), (6, 1, 128)])
@pytest.mark.parametrize("threads", [1, 3])
def test_kernel_matches_sdpa(hq, hkv, d, threads):
    g = torch.Generator().manual_seed(hq * 100 + d)
    num_slots, n = 600, 7
    k_cache = torch.randn(num_slots, hkv, d, generator=g)
    v_cache = torch.randn(num_slots, hkv, d, generator=g)
    lens = torch.tensor([1, 2, 7, 8, 9, 63, 250])  # below/at/above the 8-wide vector steps
    slots = torch.cat([torch.randperm(num_slots, generator=g)[:int(L)] for L in lens])
    starts = torch.zeros(n + 1, dtype=torch.int64)
    starts[1:] = lens.cumsum(0)
    q = torch.randn(n, hq, d, generator=g) * 3  # peaky softmax: exp over a wide range
    out = paged_decode(q, k_cache, v_cache, slots, starts, d ** -0.5, num_threads=threads)
    ref = _reference(q, k_cache, v_cache, slots, starts, d ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _flags() -> frozenset:
    from kvstrata.platform import read_cpu_flags
    return frozenset(read_cpu_flags())


_HAS_AVX2 = {"avx2", "fma"} <= _flags()
_HAS_AVX512 = _HAS_AVX2 and "avx512f" in _flags()


def _bf16_dot_path() -> bool:
    from kvstrata.platform import read_cpu_flags
    return "avx512_bf16" in read_cpu_flags()


@pytest.mark.parametrize("hq,hkv", [(3, 3), (6, 3), (9, 3), (8, 2)])  # 1-4 query heads a KV head
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_bf16_query_over_bf16_pool(monkeypatch, hq, hkv, isa):
    """A bf16 model's decode: bf16 query and pool, 64-wide heads. With AVX512-BF16 the scores
    come from vdpbf16ps four tokens at a time (lengths 1-9 cover every tail of that loop):
    the same attention as SDPA over the widened rows, to bf16 output rounding, and as the
    fp32 path within it."""
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    num_slots, d = 900, 64
    k_cache = torch.randn(num_slots, hkv, d, generator=g).bfloat16()
    v_cache = torch.randn(num_slots, hkv, d, generator=g).bfloat16()
    lens = torch.tensor([1, 2, 3, 4, 5, 6, 7, 9, 64, 190, 255])
    slots = torch.cat([torch.randperm(num_slots, generator=g)[:int(L)] for L in lens])
    starts = torch.zeros(len(lens) + 1, dtype=torch.int64)
    starts[1:] = lens.cumsum(0)
    q = (torch.randn(len(lens), hq, d, generator=g) * 2).bfloat16()
    got = paged_decode(q, k_cache, v_cache, slots, starts, d ** -0.5)
    ref = _reference(q.float(), k_cache, v_cache, slots, starts, d ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=8e-3)
    as_fp32 = paged_decode(q.float(), k_cache, v_cache, slots, starts, d ** -0.5)
    torch.testing.assert_close(got.float(), as_fp32, rtol=8e-3, atol=8e-3)
    two = paged_decode(q, k_cache, v_cache, slots, starts, d ** -0.5, num_threads=2)
    assert torch.equal(two, got)  # per item the same order whatever the threads


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 20)])
def test_bf16_query_from_a_strided_view(monkeypatch, isa, hq, hkv, d):
    """A bf16 model's query comes straight from its fused qkv projection (rows strided, bf16)
    and the output is bf16: equal to converting q to fp32, running the fp32-query kernel and
    rounding the result to bf16 (what the attention backend did before, in two torch ops)."""
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    q, k_cache, v_cache, slots, starts = _case(hq, hkv, d, torch.bfloat16)
    n = q.shape[0]
    qkv = torch.randn(n, (hq + 2 * hkv) * d).bfloat16()
    qkv[:, :hq * d] = q.reshape(n, -1).bfloat16()
    view = qkv[:, :hq * d].view(n, hq, d)
    assert not view.is_contiguous()
    got = paged_decode(view, k_cache, v_cache, slots, starts, d ** -0.5)
    want = paged_decode(view.float().contiguous(), k_cache, v_cache, slots, starts, d ** -0.5)
    assert got.dtype == torch.bfloat16
    if d == 64 and isa == "avx512" and _bf16_dot_path():
        # the bf16-dot score pass (paged_decode_head64_bf16.h) sums in another order
        torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3)
    else:
        assert torch.equal(got, want.bfloat16())
    one = paged_decode(view[:1], k_cache, v_cache, slots[:1], starts[:2], d ** -0.5)
    assert torch.equal(one, got[:1])


def _case(hq, hkv, d, dtype, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_slots = 600
    k_cache = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    lens = torch.tensor([1, 2, 7, 8, 9, 63, 250, 17, 33, 5, 16, 300])[:n]
    slots = torch.cat([torch.randperm(num_slots, generator=g)[:int(L)] for L in lens])
    starts = torch.zeros(n + 1, dtype=torch.int64)
    starts[1:] = lens.cumsum(0)
    q = torch.randn(n, hq, d, generator=g) * 3
    return q, k_cache, v_cache, slots, starts


@pytest.mark.parametrize("dtype", list(KV_DTYPES))
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
# 64-wide heads with 1-4 query heads per KV head take the register paths
# (csrc/paged_decode_head64.h on AVX-512, paged_decode_head64_avx2.h on AVX2); 5 per KV
# head and other widths the generic one.
@pytest.mark.parametrize("hq,hkv,d,n", [(9, 3, 64, 7), (8, 2, 32, 1), (6, 3, 48, 12),
                                        (4, 4, 64, 7), (6, 3, 64, 4), (8, 2, 64, 5),
                                        (10, 2, 64, 3)])
def test_kernel_every_dtype_and_isa(monkeypatch, dtype, isa, hq, hkv, d, n):
    """16-bit pools are widened to fp32 in the kernel: the result equals SDPA over the widened
    rows to fp32 rounding, on each instruction set the CPU has (a cap above what it has runs
    the widest it has: the call reports which ran). n=1 splits the request by KV head."""
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    q, k_cache, v_cache, slots, starts = _case(hq, hkv, d, dtype, n=n, seed=hq + d)
    ran = kernel_isa(d, dtype)
    assert ran in ("scalar", "avx2", "avx512")
    if isa == "scalar" or d % 8:
        assert ran == "scalar"
    if d % 16:  # AVX-512 needs 16-wide heads; 48 is 16-wide, so it stays eligible
        assert ran != "avx512"
    for threads in (1, 2):
        out = paged_decode(q, k_cache, v_cache, slots, starts, d ** -0.5, num_threads=threads)
        ref = _reference(q, k_cache, v_cache, slots, starts, d ** -0.5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,ctx", [(16, 512), (1, 4096)])
def test_kernel_threads_on_large_batches(dtype, n, ctx):
    """Calls above the kernel's 1 MiB parallel threshold run on OpenMP threads (n=1: split
    by KV head); the result equals one thread's and SDPA's."""
    g = torch.Generator().manual_seed(n)
    hq, hkv, d = 9, 3, 64
    k_cache = torch.randn(n * ctx + 8, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(n * ctx + 8, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(n * ctx + 8, generator=g)[:n * ctx]
    starts = torch.arange(0, n * ctx + 1, ctx)
    q = torch.randn(n, hq, d, generator=g)
    one = paged_decode(q, k_cache, v_cache, slots, starts, 0.125, num_threads=1)
    two = paged_decode(q, k_cache, v_cache, slots, starts, 0.125, num_threads=2)
    torch.testing.assert_close(two, one, rtol=0, atol=0)  # same items, same order per item
    ref = _reference(q, k_cache, v_cache, slots, starts, 0.125)
    torch.testing.assert_close(one, ref, rtol=1e-5, atol=1e-5)


def test_kernel_is_built_with_openmp():
    """setup.py compiles it with -fopenmp; without it every call would silently run on one
    thread (the large-batch test above would still pass)."""
    assert _paged_decode.openmp() is True


def test_kernel_isa_follows_the_cpu():
    """auto picks AVX-512 exactly when the CPU has it (and the head is 16-wide)."""
    from kvstrata.platform import read_cpu_flags
    flags = read_cpu_flags()
    want = "avx512" if "avx512f" in flags else ("avx2" if {"avx2", "fma", "f16c"} <= set(flags)
                                                else "scalar")
    assert _paged_decode.isa(64, 1, 2) == want


def test_kernel_refuses_bad_input(monkeypatch):
    k = torch.zeros(10, 2, 8)
    q = torch.zeros(1, 4, 8)
    starts = torch.tensor([0, 2])
    with pytest.raises(IndexError, match="slot 10 outside the pool"):
        paged_decode(q, k, k, torch.tensor([1, 10]), starts, 1.0)
    with pytest.raises(IndexError, match="starts must run from 0"):
        paged_decode(q, k, k, torch.tensor([1, 2]), torch.tensor([0, 3]), 1.0)
    with pytest.raises(ValueError, match="multiple of hkv"):
        paged_decode(torch.zeros(1, 3, 8), k, k, torch.tensor([1, 2]), starts, 1.0)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        paged_decode(q.half(), k, k, torch.tensor([1, 2]), starts, 1.0)
    with pytest.raises(ValueError, match="contiguous values"):
        paged_decode(q.transpose(1, 2).contiguous().transpose(1, 2), k, k,
                     torch.tensor([1, 2]), starts, 1.0)
    with pytest.raises(ValueError, match="out must have"):
        paged_decode(q, k, k, torch.tensor([1, 2]), starts, 1.0, out=q.bfloat16())
    with pytest.raises(ValueError, match="differ in dtype"):
        paged_decode(q, k, k.bfloat16(), torch.tensor([1, 2]), starts, 1.0)
    monkeypatch.setenv("KVSTRATA_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="KVSTRATA_CPU_ISA"):
        paged_decode(q, k, k, torch.tensor([1, 2]), starts, 1.0)


@pytest.mark.parametrize("page_size,dtype,tol", [(1, "float32", 1e-4), (4, "float32", 1e-4),
                                                 (4, "bfloat16", 0.15)])
def test_backend_kernel_on_off_same_tokens(tiny_checkpoints, tiny_prompts, monkeypatch,
                                           page_size, dtype, tol):
    """Same greedy tokens and near-equal logprobs with the kernel and with gather + SDPA,
    batched (ragged contexts in one kernel call). bf16: the kernel reads the bf16 pool and
    computes in fp32 where SDPA computes in bf16, so logprobs agree to bf16 rounding (measured:
    each bf16 path is 0.03-0.11 from the fp32 run, mean 0.02, and 0.056 from the other)."""
    from kvstrata import LLM
    from kvstrata.runner.attention import paged_decode as module
    calls = []
    real = module.run_decode  # every kernel call (DecodeCall's, the decode plan's): its rows
    monkeypatch.setattr(module, "run_decode", lambda args: calls.append(args[11]) or real(args))
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    results, used = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVSTRATA_CPU_PAGED_DECODE", flag)
        calls.clear()
        with LLM(model_path=tiny_checkpoints["llama"], skip_tokenizer_init=True,
                 dtype=dtype, page_size=page_size, max_total_tokens=1024) as llm:
            results[flag] = llm.generate(input_ids=tiny_prompts, sampling_params=params)
        used[flag] = max(calls, default=0)
    assert used["1"] == len(tiny_prompts) and used["0"] == 0  # all decodes in one call; off
    compared = 0
    for on, off in zip(results["1"], results["0"]):
        if dtype == "float32":
            assert on["output_ids"] == off["output_ids"]
        # bf16 (random weights, many near-ties): the two roundings may pick different tokens
        # at a tie; up to the first difference the runs see the same context, so their
        # logprobs must agree there.
        same = next((i for i, (a, b) in enumerate(zip(on["output_ids"], off["output_ids"]))
                     if a != b), len(on["output_ids"]))
        got = [lp for lp, _ in on["meta_info"]["output_token_logprobs"][:same]]
        want = [lp for lp, _ in off["meta_info"]["output_token_logprobs"][:same]]
        assert max((abs(a - b) for a, b in zip(got, want)), default=0.0) < tol
        compared += same
    assert compared >= 2 * len(tiny_prompts)  # decode steps were compared, not just prefill


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


def test_decode_call_equals_paged_decode_layer_after_layer():
    """DecodeCall (one forward's layers: checked once, then addresses swapped) returns what
    paged_decode returns for each layer's own q, caches and strided q views; a call whose
    shapes or dtypes differ is checked again (and refused when bad) instead of reusing the
    kept arguments."""
    q, k_cache, v_cache, slots, starts = _case(9, 3, 64, torch.bfloat16, n=7)
    call = DecodeCall(slots, starts, 0.125)
    g = torch.Generator().manual_seed(5)
    for layer in range(4):
        qkv = torch.randn(7, 15 * 64, generator=g).bfloat16()  # q | k | v of one token a row
        ql = qkv[:, :9 * 64].view(7, 9, 64)
        kl, vl = k_cache + layer, v_cache - layer
        assert torch.equal(call(ql, kl, vl), paged_decode(ql, kl, vl, slots, starts, 0.125))
    assert torch.equal(call(q.bfloat16(), k_cache, v_cache),  # contiguous q: checked again
                       paged_decode(q.bfloat16(), k_cache, v_cache, slots, starts, 0.125))
    assert torch.equal(call(q, k_cache.float(), v_cache.float()),  # fp32: checked again
                       paged_decode(q, k_cache.float(), v_cache.float(), slots, starts, 0.125))
    with pytest.raises(ValueError, match="differ in dtype"):
        call(q, k_cache.float(), v_cache)
    with pytest.raises(IndexError, match="outside the pool"):  # a smaller pool: re-checked
        call(q, k_cache[:100].float(), v_cache[:100].float())
