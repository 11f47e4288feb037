"""The sampled acceptance rule at a draft node (runner/spec/verify.py, SGLang's rule): with
thresholds 1.0 the output token is distributed as the target's p whatever the children;
below 1.0 drafts pass more often, as --speculative-accept-threshold-single / -acc say."""
from __future__ import annotations

from collections import Counter

import torch

from kvstrata.protocol import SamplingParams
from kvstrata.runner.sampling.sampler import SamplingState
from kvstrata.runner.spec.verify import _sample_children

P = torch.tensor([0.1, 0.2, 0.3, 0.4])  # unnormalised on purpose: x2 below
N = 3000  # 4 sigma of a 0.4 frequency: 0.036


def draws(children, thresholds=(1.0, 1.0), p=P) -> Counter:
    torch.manual_seed(0)
    out = Counter()
    for k in range(N):
        state = SamplingState(SamplingParams(temperature=1.0, seed=k), [1], [])
        u = torch.tensor([(k * 0.6180339887) % 1.0])
        out[_sample_children(p * 2, [(j + 1, d) for j, d in enumerate(children)], state, u,
                             thresholds)] += 1
    return out


def test_children_keep_the_target_distribution():
    for children in ([], [3], [2, 0], [1, 3, 2], [0, 1, 2, 3]):
        got = draws(children)
        for tok in range(4):
            assert abs(got[tok] / N - float(P[tok])) < 0.036, (children, tok, got)


def test_thresholds_below_one_accept_more():
    exact = draws([1])[1] / N                   # p(1) = 0.2
    single = draws([2], (0.3, 1.0))[2] / N      # p(2) = 0.3 >= 0.3: always
    acc = draws([1], (1.0, 0.5))[1] / N         # u < 0.2 / 0.5
    assert abs(exact - 0.2) < 0.036 and single == 1.0 and abs(acc - 0.4) < 0.036


def test_verify_with_an_overflowing_repetition_penalty_stays_in_the_vocabulary():
    """Regression beside the sampler's: a tiny repetition_penalty makes seen tokens' logits
    +inf; verification draws and accepts only among them (their limit), never an id past
    the vocabulary, and its logprobs are finite."""
    from kvstrata.runner.sampling.sampler import Sampler
    from kvstrata.runner.spec.verify import verify

    vocab, seen = 40, [5, 6]
    logits = [torch.rand(3, vocab, generator=torch.Generator().manual_seed(k)) + 0.5
              for k in range(4)]
    for k in range(4):
        states = [SamplingState(SamplingParams(temperature=1.0, seed=k, logprobs=2,
                                               repetition_penalty=5e-324), seen, [])]
        results, _ = verify(Sampler(vocab, [0]), [logits[k]], states, [[5, 9]])
        for token, lp, top in results[0]:
            assert token in seen and lp > -10000.0 and all(v >= -9999.0 for _, v in top)


def test_verify_applies_logit_bias_as_plain_decoding_does():
    """A draft is checked against the biased target: greedy accepts the banned-then-boosted
    token only where the bias makes it the argmax, exactly as a step without drafts would."""
    from kvstrata.runner.sampling.sampler import Sampler
    from kvstrata.runner.spec.verify import verify

    vocab = 12
    logits = torch.rand(3, vocab, generator=torch.Generator().manual_seed(3))
    top = int(logits[0].argmax())
    bias = {top: -100.0, 4: 50.0}
    sampler = Sampler(vocab, [0])
    state = SamplingState(SamplingParams(temperature=0.0, logit_bias=bias), [1], [])
    results, path = verify(sampler, [logits], [state], [[4, 4]])
    assert [t for t, _, _ in results[0]] == [4, 4, 4] and path == [[1, 2]]
    plain = SamplingState(SamplingParams(temperature=0.0, logit_bias=bias), [1], [])
    assert sampler(logits[:1], [plain]).token_ids == [4]
    # unbiased, the same draft is rejected at once (4 is not the row's argmax)
    assert top != 4
    state = SamplingState(SamplingParams(temperature=0.0), [1], [])
    results, path = verify(sampler, [logits], [state], [[4, 4]])
    assert [t for t, _, _ in results[0]] == [top] and path == [[]]
