"""The paged decode kernel's softmax extras (csrc/paged_decode_isa.h `softmax`): attention sinks
(gpt-oss: a learned logit per query head that joins the softmax and has no value) and logit
soft-capping (Gemma 2: scores = cap * tanh(scores / cap) after scaling), on every instruction
set body and storage dtype, against a float64 torch reference written from transformers'
eager attention of those models; and the property deterministic inference needs of them: a
query's bits do not depend on the other rows of the call (row counts 1..64, threads)."""
from __future__ import annotations

import pytest
import torch

from kvstrata.runner.attention.paged_decode import DecodeCall, kernel_isa, paged_decode


def _reference(q, k_cache, v_cache, slots, starts, ends, scale, sinks, softcap):
    """float64: transformers' gpt-oss / Gemma 2 eager attention of one query row at a time."""
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.zeros(n, hq, d, dtype=torch.float64)
    for b in range(n):
        idx = slots[starts[b]:ends[b]]
        k = k_cache[idx].double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        v = v_cache[idx].double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        s = (q[b].double()[:, None, :] @ k.transpose(1, 2))[:, 0] * scale   # [Hq, S]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], dim=1)
        p = torch.softmax(s, dim=1)
        if sinks is not None:
            p = p[:, :-1]  # the sink's probability mass is dropped
        out[b] = (p[:, None, :] @ v)[:, 0]
    return out


def _case(hq, hkv, d, dtype, lens, seed):
    g = torch.Generator().manual_seed(seed)
    num_slots = 700
    k_cache = (torch.randn(num_slots, hkv, d, generator=g) * 2).to(dtype)
    v_cache = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    slots = torch.cat([torch.randperm(num_slots, generator=g)[:L] for L in lens])
    starts = torch.zeros(len(lens) + 1, dtype=torch.int64)
    starts[1:] = torch.tensor(lens).cumsum(0)
    q = torch.randn(len(lens), hq, d, generator=g) * 2  # peaky: soft-capping bites
    # sinks around the scores' range: some rows give the sink most of the mass, some little
    sinks = torch.randn(hq, generator=g) * 4
    return q, k_cache, v_cache, slots, starts, sinks


EXTRAS = [("sinks", 0.0), ("softcap", 5.0), ("both", 3.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
# 64-wide heads with 1-4 query heads a KV head take the register bodies (head64 AVX-512 /
# AVX2, and with AVX512-BF16 and a bf16 query the bf16-dot one); the others the generic body
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 64), (8, 2, 32),
                                      (10, 2, 64), (6, 3, 20)])
@pytest.mark.parametrize("extras", EXTRAS, ids=[e[0] for e in EXTRAS])
def test_sinks_and_softcap_match_float64(monkeypatch, dtype, isa, hq, hkv, d, extras):
    monkeypatch.setenv("KVSTRATA_CPU_ISA", isa)
    which, softcap = extras
    lens = [1, 2, 7, 9, 63, 250]  # below / above the vector steps, and long rows
    q, k_cache, v_cache, slots, starts, sinks = _case(hq, hkv, d, dtype, lens, hq * d)
    sinks = None if which == "softcap" else sinks
    assert kernel_isa(d, dtype) in ("scalar", "avx2", "avx512")
    ref = _reference(q, k_cache, v_cache, slots, starts, starts[1:], d ** -0.5, sinks, softcap)
    got = paged_decode(q, k_cache, v_cache, slots, starts, d ** -0.5, sinks=sinks,
                       softcap=softcap)
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5)
    if dtype == torch.bfloat16:  # a bf16 model's call: bf16 query and output
        qb = q.bfloat16()
        ref = _reference(qb, k_cache, v_cache, slots, starts, starts[1:], d ** -0.5, sinks,
                         softcap)
        got = paged_decode(qb, k_cache, v_cache, slots, starts, d ** -0.5, sinks=sinks,
                           softcap=softcap)
        torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2)


def test_no_extras_changes_nothing():
    """sinks=None, softcap=0 is the plain kernel, and a sink of -inf has no mass: the same
    numbers bit for bit (the extras touch only the softmax's max and sum)."""
    q, k_cache, v_cache, slots, starts, sinks = _case(9, 3, 64, torch.bfloat16, [5, 40, 200], 1)
    plain = paged_decode(q, k_cache, v_cache, slots, starts, 0.125)
    assert torch.equal(plain, paged_decode(q, k_cache, v_cache, slots, starts, 0.125,
                                           sinks=None, softcap=0.0))
    no_mass = torch.full((9,), float("-inf"))
    assert torch.equal(plain, paged_decode(q, k_cache, v_cache, slots, starts, 0.125,
                                           sinks=no_mass))


def test_a_query_without_keys_gives_the_sink_everything():
    """An empty key range: the sink holds all the mass and it has no value, so the output is
    zero (transformers' softmax over the sink column alone, then dropped)."""
    q, k_cache, v_cache, slots, _, sinks = _case(4, 2, 32, torch.float32, [3], 2)
    out = paged_decode(q, k_cache, v_cache, slots, torch.tensor([0]), 0.2, sinks=sinks,
                       ends=torch.tensor([0]))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 32)])
def test_rows_do_not_depend_on_the_batch(dtype, hq, hkv, d):
    """Deterministic inference's property with the extras on: the first r rows of a call
    (r = 1 .. 64, ranges over one shared slot list as a prompt's queries, so a call reads
    enough bytes to run on threads and few rows split by KV head) equal the same rows run
    alone and in the full call, bit for bit, on 1 or 2 threads."""
    g = torch.Generator().manual_seed(hq + d)
    lens = torch.randint(1, 400, (64,), generator=g).tolist()
    q, k_cache, v_cache, slots, _, sinks = _case(hq, hkv, d, dtype, [400], hq)
    q = torch.randn(64, hq, d, generator=g).to(dtype) * 2
    starts = torch.zeros(64, dtype=torch.int64)
    ends = torch.tensor(lens)
    args = dict(sinks=sinks, softcap=4.0)
    full = paged_decode(q, k_cache, v_cache, slots, starts, d ** -0.5, ends=ends, **args)
    for r in range(1, 65):
        threads = 1 + r % 2  # the full call ran on torch's thread count
        part = paged_decode(q[:r], k_cache, v_cache, slots, starts[:r], d ** -0.5,
                            ends=ends[:r], num_threads=threads, **args)
        assert torch.equal(part, full[:r]), (r, threads)
    for b in (0, 31, 63):
        alone = paged_decode(q[b:b + 1], k_cache, v_cache, slots[:lens[b]].contiguous(),
                             torch.tensor([0, lens[b]]), d ** -0.5, **args)
        assert torch.equal(alone, full[b:b + 1])


def test_decode_call_takes_each_layers_sinks():
    """DecodeCall keeps one forward's arguments across layers: each layer's own sink logits
    (an address swapped in) and soft-cap give what paged_decode gives for that layer; a
    soft-cap other than the kept one is checked again."""
    q, k_cache, v_cache, slots, starts, sinks = _case(9, 3, 64, torch.bfloat16, [3, 70, 9], 3)
    q = q.bfloat16()
    call = DecodeCall(slots, starts, 0.125)
    for layer in range(3):
        s = sinks + layer
        got = call(q, k_cache, v_cache, sinks=s, softcap=2.0)
        assert torch.equal(got, paged_decode(q, k_cache, v_cache, slots, starts, 0.125,
                                             sinks=s, softcap=2.0))
    assert torch.equal(call(q, k_cache, v_cache, softcap=7.0),
                       paged_decode(q, k_cache, v_cache, slots, starts, 0.125, softcap=7.0))
    assert torch.equal(call(q, k_cache, v_cache),
                       paged_decode(q, k_cache, v_cache, slots, starts, 0.125))


def test_extras_are_checked():
    q, k_cache, v_cache, slots, starts, sinks = _case(4, 2, 32, torch.float32, [3, 4], 4)
    with pytest.raises(ValueError, match="one logit per query head"):
        paged_decode(q, k_cache, v_cache, slots, starts, 0.2, sinks=sinks[:3])
    with pytest.raises(ValueError, match="sinks must be fp32"):
        paged_decode(q, k_cache, v_cache, slots, starts, 0.2, sinks=sinks.bfloat16())
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        paged_decode(q, k_cache, v_cache, slots, starts, 0.2, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        paged_decode(q, k_cache, v_cache, slots, starts, 0.2, softcap=float("nan"))
