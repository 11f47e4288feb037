"""The CPU paged decode kernel (runner/attention/paged_decode.py) against torch SDPA over the
same K/V gathered by hand, and the attention backend with the kernel on vs off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.runner.attention.paged_decode import paged_decode


def _reference(q, k_cache, v_cache, slots, starts, scale):
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = []
    for b in range(n):
        idx = slots[starts[b]:starts[b + 1]]
        k, v = k_cache[idx].transpose(0, 1), v_cache[idx].transpose(0, 1)   # [Hkv, S, D]
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


def test_kernel_refuses_bad_input():
    k = torch.zeros(10, 2, 8)
    q = torch.zeros(1, 4, 8)
    starts = torch.tensor([0, 2])
    with pytest.raises(IndexError, match="slot 10 outside the pool"):
        paged_decode(q, k, k, torch.tensor([1, 10]), starts, 1.0)
    with pytest.raises(IndexError, match="starts must run from 0"):
        paged_decode(q, k, k, torch.tensor([1, 2]), torch.tensor([0, 3]), 1.0)
    with pytest.raises(ValueError, match="multiple of hkv"):
        paged_decode(torch.zeros(1, 3, 8), k, k, torch.tensor([1, 2]), starts, 1.0)
    with pytest.raises(ValueError, match="float32"):
        paged_decode(q.half(), k, k, torch.tensor([1, 2]), starts, 1.0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_backend_kernel_on_off_same_tokens(tiny_checkpoints, tiny_prompts, monkeypatch,
                                           page_size):
    """Same greedy tokens and near-equal logprobs with the kernel and with gather + SDPA,
    batched (ragged contexts in one kernel call)."""
    from kvstrata import LLM
    from kvstrata.runner.attention import paged_decode as module
    calls = []
    real = module.paged_decode
    monkeypatch.setattr(module, "paged_decode",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    results, used = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVSTRATA_CPU_PAGED_DECODE", flag)
        calls.clear()
        with LLM(model_path=tiny_checkpoints["llama"], skip_tokenizer_init=True,
                 dtype="float32", page_size=page_size, max_total_tokens=1024) as llm:
            results[flag] = llm.generate(input_ids=tiny_prompts, sampling_params=params)
        used[flag] = max(calls, default=0)
    assert used["1"] == len(tiny_prompts) and used["0"] == 0  # all decodes in one call; off
    for on, off in zip(results["1"], results["0"]):
        assert on["output_ids"] == off["output_ids"]
        got = [lp for lp, _ in on["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _ in off["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
