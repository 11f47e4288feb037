"""Sampler vs. torch references computed here: greedy, penalties, truncation, seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from kvstrata.protocol.sampling_params import SamplingParams
from kvstrata.runner.sampling.sampler import Sampler, SamplingState

EOS = 7


def st(prompt=(), output=(), **kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), list(prompt), list(output))


def ref_probs(logits: torch.Tensor, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Independent reference of the truncated, renormalised distribution for one row."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    keep = torch.ones_like(p, dtype=torch.bool)
    order = torch.argsort(p, descending=True).tolist()
    if top_k > 0:
        keep[:] = False
        keep[order[:top_k]] = True
    q = torch.where(keep, p, 0.0)
    q = q / q.sum()
    if top_p < 1.0:
        mass, kept = 0.0, []
        for i in order:
            if not keep[i]:
                continue
            kept.append(i)
            mass += q[i].item()
            if mass >= top_p:
                break
        keep[:] = False
        keep[kept] = True
        q = torch.where(keep, q, 0.0)
        q = q / q.sum()
    if min_p > 0.0:
        keep &= q >= min_p * q.max()
        q = torch.where(keep, q, 0.0)
        q = q / q.sum()
    return q


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    exp = probs * n
    mask = exp > 0
    return (((counts[mask] - exp[mask]) ** 2) / exp[mask]).sum().item()


SMALL = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.2, -0.5, -1.0, 0.0])  # V=8, EOS = 7


# ---------------------------------------------------------------- greedy
def test_greedy_batch_is_argmax_and_bf16_ok():
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    s = Sampler(300, [EOS])
    states = [st(temperature=0.0) for _ in range(3)] + [st(top_k=1) for _ in range(2)]
    res = s(logits, states)
    assert res.token_ids == logits.argmax(-1).tolist()
    assert res.logprobs == [None] * 5 and res.top_logprobs == [None] * 5
    lb = logits.bfloat16()
    assert s(lb, states).token_ids == lb.float().argmax(-1).tolist()


def test_greedy_ties_take_the_first_index_as_argmax():
    """The greedy path reads max(dim).indices (faster on CPU): ties must still go to the
    first index, as torch.argmax, on wide rows (vectorised reductions) and in bf16."""
    from kvstrata.runner.sampling.sampler import greedy_ids
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randint(0, 4, (32, 49152), generator=g).to(dtype)  # ties everywhere
        logits[:, 40000:] = 3.0
        assert greedy_ids(logits) == logits.argmax(-1).tolist()
        assert greedy_ids(logits) == logits.float().argmax(-1).tolist()


def test_greedy_rows_in_mixed_batch_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 100)
    states = [st(temperature=0.0), st(temperature=1.0), st(temperature=0.0, logprobs=2),
              st(temperature=0.7, top_p=0.9, seed=3), st(top_k=1), st(min_p=0.1)]
    res = Sampler(100, [EOS])(logits, states)
    for i in (0, 2, 4):
        assert res.token_ids[i] == int(logits[i].argmax())
    assert all(0 <= t < 100 for t in res.token_ids)


def test_padded_vocab_never_sampled():
    logits = torch.zeros(3, 12)
    logits[:, 10:] = 100.0  # padding columns of the lm_head
    states = [st(temperature=0.0), st(temperature=1.0), st(temperature=1.0, seed=1)]
    res = Sampler(10, [EOS])(logits, states)
    assert all(t < 10 for t in res.token_ids)


# ---------------------------------------------------------------- penalties
def test_penalties_match_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    orig = logits.clone()
    state = st(prompt=[0, 1], output=[3, 3, 2], temperature=0.0, repetition_penalty=2.0,
               frequency_penalty=0.5, presence_penalty=0.25, logprobs=6)
    # repetition over prompt+output {0,1,2,3}: 2/2, -1*2, .5/2, 3/2; then over output only:
    # id 3 (count 2): 1.5 - 2*.5 - .25 = .25; id 2 (count 1): .25 - .5 - .25 = -.5
    expected = torch.tensor([1.0, -2.0, -0.5, 0.25, -2.0, 0.0])
    res = Sampler(6, [5])(logits, [state])
    assert torch.equal(logits, orig), "caller's logits must not be mutated"
    assert res.token_ids == [0]
    ref = torch.log_softmax(expected, -1)
    got = dict(res.top_logprobs[0])
    for t in range(6):
        assert got[t] == pytest.approx(ref[t].item(), abs=1e-6)
    assert res.logprobs[0] == pytest.approx(ref[0].item(), abs=1e-6)


def test_frequency_presence_ignore_prompt_and_repetition_covers_prompt():
    logits = torch.tensor([[1.0, 0.9, 0.0, 0.0]])
    # Prompt-only token 0 is not hit by frequency/presence: token 0 stays the argmax.
    r = Sampler(4, [3])(logits, [st(prompt=[0], output=[1], temperature=0.0,
                                    frequency_penalty=2.0, presence_penalty=2.0)])
    assert r.token_ids == [0]
    # ... but repetition_penalty does cover the prompt: 1.0/2 < 0.9.
    r = Sampler(4, [3])(logits, [st(prompt=[0], temperature=0.0, repetition_penalty=2.0)])
    assert r.token_ids == [1]
    # Negative frequency penalty rewards repetition.
    r = Sampler(4, [3])(logits, [st(output=[2, 2], temperature=0.0, frequency_penalty=-1.0)])
    assert r.token_ids == [2]


def test_logit_bias_adds_after_penalties_and_steers_greedy_sampled_and_logprobs():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    s = Sampler(6, [5])
    # SGLang's order: penalties first (3 / 2 = 1.5 for the seen token 3), then the bias.
    state = st(prompt=[3], temperature=0.0, repetition_penalty=2.0,
               logit_bias={4: 4.5, 0: -100.0, 99: 50.0}, logprobs=6)  # 99: past the vocab
    res = s(logits, [state])
    expected = torch.tensor([-98.0, -1.0, 0.5, 1.5, 2.5, 0.0])
    assert res.token_ids == [4]
    ref = torch.log_softmax(expected, -1)
    for t, lp in res.top_logprobs[0]:
        assert lp == pytest.approx(ref[t].item(), abs=1e-5)
    # a sampled row draws only the favoured token once its bias dwarfs the others
    many = s(logits.expand(500, 6).contiguous(),
             [st(logit_bias={1: 100.0}) for _ in range(500)])
    assert set(many.token_ids) == {1}
    # -100 bans: never drawn from a flat row
    flat = s(torch.zeros(2000, 6), [st(logit_bias={2: -100.0, 3: -100}) for _ in range(2000)])
    assert not set(flat.token_ids) & {2, 3}
    # the bias is per request: a neighbour in the batch is not affected
    both = s(logits.expand(2, 6).contiguous(),
             [st(temperature=0.0, logit_bias={1: 10.0}), st(temperature=0.0)])
    assert both.token_ids == [1, 3]


# ---------------------------------------------------------------- min_new_tokens
def test_min_new_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 10.0]])  # EOS(7) max, then 2
    s = Sampler(8, [EOS])
    blocked = st(output=[1], temperature=0.0, min_new_tokens=2, stop_token_ids=[2], logprobs=1)
    r = s(logits, [blocked])
    assert r.token_ids[0] not in (EOS, 2)
    assert r.top_logprobs[0][0][0] not in (EOS, 2)
    assert s(logits, [st(output=[1, 1], temperature=0.0, min_new_tokens=2)]).token_ids == [EOS]
    many = s(logits.expand(2000, 8).contiguous(),
             [st(output=[], min_new_tokens=1, stop_token_ids=[2]) for _ in range(2000)])
    assert not set(many.token_ids) & {EOS, 2}


# ---------------------------------------------------------------- truncation + distribution
@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(top_k=3),
    dict(top_p=0.7),
    dict(min_p=0.2),
    dict(temperature=1.5, top_k=5, top_p=0.8, min_p=0.1),
])
def test_filtered_distribution_matches_reference(kw):
    n = 8000
    torch.manual_seed(1234)
    ref = ref_probs(SMALL, **{k: v for k, v in kw.items()})
    res = Sampler(8, [EOS])(SMALL.expand(n, 8).contiguous(), [st(**kw) for _ in range(n)])
    counts = torch.bincount(torch.tensor(res.token_ids), minlength=8).double()
    assert (counts[ref == 0] == 0).all(), f"filtered token sampled: {counts} vs {ref}"
    df = int((ref > 0).sum()) - 1
    # chi-square with <= 7 dof: 30 is far past the 99.99th percentile.
    assert df == 0 or chi_square(counts, ref) < 30, (counts / n, ref)


def test_mixed_params_in_one_batch_each_match_reference():
    # Different top_k / top_p per row exercises the per-row masks (not just one topk cut).
    groups = [dict(top_k=2), dict(top_k=4, top_p=0.9), dict(), dict(top_p=0.6, min_p=0.3),
              dict(temperature=0.0)]
    per = 3000
    torch.manual_seed(77)
    states = [st(**groups[i % len(groups)]) for i in range(per * len(groups))]
    logits = SMALL.expand(len(states), 8).contiguous()
    toks = torch.tensor(Sampler(8, [EOS])(logits, states).token_ids)
    for g, kw in enumerate(groups):
        mine = toks[g::len(groups)]
        if kw.get("temperature") == 0.0:
            assert (mine == 0).all()
            continue
        ref = ref_probs(SMALL, **kw)
        counts = torch.bincount(mine, minlength=8).double()
        assert (counts[ref == 0] == 0).all(), (kw, counts, ref)
        assert chi_square(counts, ref) < 30, (kw, counts / per, ref)


def test_seeded_rows_have_correct_distribution():
    n = 6000
    kw = dict(temperature=0.8, top_k=6, top_p=0.95)
    ref = ref_probs(SMALL, **kw)
    states = [st(output=[0] * (i % 5), seed=i, **kw) for i in range(n)]
    res = Sampler(8, [EOS])(SMALL.expand(n, 8).contiguous(), states)
    counts = torch.bincount(torch.tensor(res.token_ids), minlength=8).double()
    assert (counts[ref == 0] == 0).all()
    assert chi_square(counts, ref) < 30


def test_ties_at_the_cut_are_kept_and_top_p_keeps_first():
    # Value-threshold semantics: top_k=2 with four tied leaders keeps all four.
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, -5.0]]).expand(4000, 5).contiguous()
    res = Sampler(5, [EOS])(logits, [st(top_k=2) for _ in range(4000)])
    assert set(res.token_ids) == {0, 1, 2, 3}
    # A dominant token with tiny top_p: only it survives.
    one = torch.tensor([[10.0, 0.0, 0.0, 0.0, 0.0]]).expand(500, 5).contiguous()
    res = Sampler(5, [EOS])(one, [st(top_p=0.01) for _ in range(500)])
    assert set(res.token_ids) == {0}


@pytest.mark.parametrize("scale", [8.0, 0.5])  # peaked: nucleus in the prefix; flat: spills
def test_top_p_prefix_fast_path_matches_full_sort(scale, monkeypatch):
    torch.manual_seed(11)
    vocab = 5000
    logits = torch.randn(6, vocab) * scale
    ks = [vocab, vocab, 40, vocab, 3000, vocab]
    tops = [0.9, 0.5, 0.8, 1.0, 0.95, 0.99]
    full = Sampler._cut_threshold(logits, ks, tops, width=vocab)
    widths = []
    orig = Sampler._cut_threshold

    def spy(*a, width=None):
        widths.append(width)
        return orig(*a, width=width)

    monkeypatch.setattr(Sampler, "_cut_threshold", staticmethod(spy))
    fast = Sampler._cut_threshold(logits, ks, tops)
    assert torch.equal(fast, full)
    # The peaked case must be served by the prefix alone; the flat one falls back to a sort.
    assert widths == ([None] if scale > 1 else [None, vocab])
    # ... and both equal the reference kept set (values distinct, so ties do not arise).
    for i in range(6):
        ref = ref_probs(logits[i], top_k=ks[i] if ks[i] < vocab else -1, top_p=tops[i])
        assert torch.equal(logits[i] >= full[i], ref > 0)


# ---------------------------------------------------------------- seeds
def test_seed_reproducible_regardless_of_batch():
    torch.manual_seed(5)
    vocab = 1000
    rows = torch.randn(4, vocab)
    kw = dict(temperature=1.3, top_p=0.95, seed=42)
    target = lambda k: st(prompt=[1, 2], output=[3] * k, **kw)  # noqa: E731
    s = Sampler(vocab, [EOS])
    alone = [s(rows[:1], [target(k)]).token_ids[0] for k in range(8)]
    assert len(set(alone)) > 1, "different steps must get different randomness"
    for k in range(8):
        torch.manual_seed(100 + k)  # the global generator must not matter
        batch = torch.cat([rows[1:3], rows[:1], rows[3:]])
        states = [st(output=[0] * 9, seed=7, temperature=1.0), st(output=[0] * 2),
                  target(k), st(output=[0] * k, temperature=0.0, logprobs=3)]
        assert s(batch, states).token_ids[2] == alone[k]
    # A fresh sampler (another process, say) gives the same stream.
    assert [Sampler(vocab, [EOS])(rows[:1], [target(k)]).token_ids[0]
            for k in range(8)] == alone
    other = [s(rows[:1], [st(prompt=[1, 2], output=[3] * k, temperature=1.3, top_p=0.95,
                             seed=43)]).token_ids[0] for k in range(8)]
    assert other != alone


def test_seed_reproducible_across_truncation_paths_with_ties():
    # bf16-rounded logits have many ties; alone the target's top-p uses the top-k prefix,
    # in the batch a flat top-p row forces a full sort and a top_k row sets another width.
    torch.manual_seed(8)
    vocab = 3000
    peaked = (torch.randn(vocab) * 4).bfloat16().float()
    flat = torch.randn(vocab) * 0.1
    s = Sampler(vocab, [EOS])
    kw = dict(temperature=1.0, top_p=0.9, min_p=0.01, seed=2024)
    for k in range(6):
        alone = s(peaked[None], [st(output=[1] * k, **kw)]).token_ids[0]
        batch = torch.stack([flat, peaked, peaked])
        states = [st(top_p=0.99, seed=5), st(output=[1] * k, **kw), st(top_k=7, output=[2])]
        assert s(batch, states).token_ids[1] == alone


def test_unseeded_follows_global_generator():
    logits = torch.randn(16, 500)
    states = [st(temperature=2.0) for _ in range(16)]
    torch.manual_seed(9)
    a = Sampler(500, [EOS])(logits, states).token_ids
    torch.manual_seed(9)
    b = Sampler(500, [EOS])(logits, states).token_ids
    assert a == b


# ---------------------------------------------------------------- logprobs
def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    torch.manual_seed(3)
    logits = torch.randn(3, 50) * 3
    states = [st(temperature=0.3, top_k=5, logprobs=5, seed=1), st(temperature=0.0, logprobs=0),
              st(temperature=1.0)]
    res = Sampler(50, [EOS])(logits, states)
    ref = torch.log_softmax(logits.float(), -1)
    for i in (0, 1):
        assert res.logprobs[i] == pytest.approx(ref[i, res.token_ids[i]].item(), abs=1e-6)
    assert res.top_logprobs[1] == []
    assert res.logprobs[2] is None and res.top_logprobs[2] is None
    top = res.top_logprobs[0]
    vals, ids = ref[0].topk(5)
    assert [t for t, _ in top] == ids.tolist()
    assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-6)
    assert all(top[j][1] >= top[j + 1][1] for j in range(4))
    assert all(math.isfinite(v) for _, v in top)


def test_inverse_cdf_edges_never_return_zero_prob_or_out_of_range():
    probs = torch.tensor([[0.5, 0.5, 0.0]])  # the last token is filtered out
    for u in (1.0 - 2.0 ** -24, 1.0):  # largest float32 below 1, and the closed end itself
        assert Sampler.inverse_cdf(probs, torch.tensor([u])) == [1]
    assert Sampler.inverse_cdf(probs, torch.tensor([0.0])) == [0]
    assert Sampler.inverse_cdf(torch.tensor([[0.0, 0.3, 0.0, 0.7]]), torch.tensor([0.0])) == [1]


def test_tiny_temperatures_are_greedy_and_nan_rows_do_not_crash():
    """Regression (schema fuzz): temperature 5e-324 overflowed the logits to inf, the top-p
    masses became NaN, no token was kept and index -1 crashed the scheduler process.
    Below 1e-6 sampling is greedy (SGLang's rule); a NaN row still keeps its first token."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(50, [0])
    states = [SamplingState(SamplingParams(temperature=t, top_p=0.9), [1, 2], [])
              for t in (5e-324, 9e-7)]
    assert all(s.params.is_greedy for s in states)
    assert sampler(logits, states).token_ids == logits.argmax(dim=-1).tolist()
    nan_row = torch.full((1, 50), float("nan"))
    thr = Sampler._cut_threshold(nan_row, [50], [0.5])
    assert thr.shape == (1, 1)


@pytest.mark.parametrize("kw", [dict(), dict(top_p=0.5), dict(top_k=3), dict(min_p=0.5),
                                dict(temperature=0.0)])
def test_overflowing_penalties_and_nan_logits_stay_in_the_vocabulary(kw):
    """Regression (schema fuzz): a valid tiny repetition_penalty divided seen logits to +inf,
    softmax gave NaN and the inverse CDF returned the vocabulary size as a token id (the next
    step's embedding lookup took the scheduler down). The +inf tokens now share the row, NaN
    is never drawn, a row with nothing finite draws inside the vocabulary, and logprobs stay
    finite (-inf as -9999.0, vLLM's floor)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 60, generator=gen).abs() + 0.1  # positive: / r overflows
    logits[2, :] = float("nan")
    logits[3, 5] = float("nan")
    sampler = Sampler(60, [0])
    seen = [11, 12, 13]
    states = [st(prompt=seen, output=[11], repetition_penalty=5e-324, logprobs=4, **kw),
              st(prompt=[1], output=[], logprobs=2, **kw),
              st(prompt=[1], output=[], logprobs=2, **kw),
              st(prompt=[1], output=[], **kw)]
    for _ in range(20):
        r = sampler(logits, states)
        assert r.token_ids[0] in seen  # the +inf tokens have all the mass
        assert all(0 <= t < 60 for t in r.token_ids) and r.token_ids[3] != 5
        for lp, top in zip(r.logprobs[:3], r.top_logprobs[:3]):
            assert math.isfinite(lp) and all(math.isfinite(v) and v >= -9999.0
                                             for _, v in top)
    assert r.logprobs[0] == pytest.approx(math.log(1 / 3), abs=1e-6)


def test_token_ids_logprob_follow_the_top_n_in_the_asked_order():
    """SGLang's token_ids_logprob: after a row's top-n, the log-softmax at the asked ids in
    their order (an id past the row reports the floor), one gather for rows that ask the
    same ids, per row otherwise; split_top_logprobs takes them apart again."""
    from kvstrata.protocol.sampling_params import split_top_logprobs
    from kvstrata.runner.sampling.sampler import LOGPROB_FLOOR, top_rows

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    ref = torch.log_softmax(logits, -1)
    same = SamplingParams(logprobs=2, token_ids_logprob=[4, 0, 9])
    rows = top_rows(ref, [same, same])
    other = top_rows(ref, [same, SamplingParams(logprobs=0, token_ids_logprob=[1])])
    for j, row in enumerate(rows):
        top, asked = split_top_logprobs(row, same)
        assert [t for t, _ in top] == ref[j].topk(2).indices.tolist()
        assert [t for t, _ in asked] == [4, 0, 9]
        assert asked[0][1] == pytest.approx(ref[j, 4].item()) and asked[2][1] == LOGPROB_FLOOR
    assert other[0] == rows[0] and other[1] == [(1, pytest.approx(ref[1, 1].item()))]
    # through the sampler: the sampled row's list is the same
    res = Sampler(6, [5])(logits[:1], [st(temperature=0.0, logprobs=2,
                                          token_ids_logprob=[4, 0, 9])])
    assert [t for t, _ in res.top_logprobs[0]] == [t for t, _ in rows[0]]
    assert [v for _, v in res.top_logprobs[0]] == pytest.approx([v for _, v in rows[0]])
    with pytest.raises(ValueError, match="^token_ids_logprob needs logprobs"):
        SamplingParams(token_ids_logprob=[1])
