"""The CPU paged decode kernel (runner/attention/paged_decode.py) against torch SDPA over the
same K/V gathered by hand (every pool dtype, every instruction set this CPU has), and the
attention backend with the kernel on vs off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.runner.attention import _paged_decode
from kvstrata.runner.attention.paged_decode import KV_DTYPES, DecodeCall, kernel_isa, paged_decode


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
        # the default paths the switch chooses between (deterministic inference, on by
        # default at bf16 on AVX2, runs every token through the kernel)
        with LLM(model_path=tiny_checkpoints["llama"], skip_tokenizer_init=True,
                 dtype=dtype, page_size=page_size, max_total_tokens=1024,
                 disable_deterministic_inference=True) as llm:
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
