"""Randomised: any valid SamplingParams over any logits row (extreme values, +inf / -inf /
NaN entries, a padded vocabulary) yields token ids inside the vocabulary and finite
logprobs, through the sampler and speculative verification alike. The schema fuzz found a
valid repetition_penalty that broke this (the vocabulary size came back as a token id and
the scheduler died); this property covers the sampler without a server. Logit biases and
token_ids_logprob (reported after the top-n, in the asked order) are drawn too, and
grammars (structured output): a row with one only ever draws tokens it allows.

KVSTRATA_FUZZ_EXAMPLES raises the example count for a soak."""
from __future__ import annotations

import math
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.protocol.sampling_params import SamplingParams, split_top_logprobs
from kvstrata.runner.sampling.sampler import Sampler, SamplingState
from kvstrata.runner.spec.verify import verify

EXAMPLES = int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "150"))
VOCAB = 24
SPECIAL = [float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38, 1e-45, 0.0]

values = st.one_of(st.floats(-50, 50), st.sampled_from(SPECIAL))
params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(1e-6, 100.0), st.just(5e-324)),
    top_p=st.one_of(st.just(1.0), st.floats(1e-9, 1.0, exclude_min=False)),
    top_k=st.one_of(st.just(-1), st.integers(1, 2 * VOCAB)),
    min_p=st.floats(0.0, 1.0),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(5e-324, 2.0)),
    frequency_penalty=st.floats(-2.0, 2.0), presence_penalty=st.floats(-2.0, 2.0),
    min_new_tokens=st.integers(0, 3), max_new_tokens=st.just(8),
    stop_token_ids=st.lists(st.integers(0, 2 * VOCAB), max_size=3),
    seed=st.one_of(st.none(), st.integers(0, (1 << 64) - 1)),
    logprobs=st.one_of(st.none(), st.integers(0, 5)),
    # ids past the vocabulary too (LLM() does not check them; the sampler ignores them)
    logit_bias=st.dictionaries(st.integers(0, 2 * VOCAB),
                               st.one_of(st.floats(-1e9, 1e9), st.sampled_from(
                                   [float("inf"), float("-inf"), 100.0, -100.0])),
                               max_size=4))
request = st.tuples(params, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
                    st.lists(st.integers(0, VOCAB - 1), max_size=4))


def _check(tokens, logprobs, tops, params):
    assert all(0 <= t < VOCAB for t in tokens), tokens
    for lp, top, p in zip(logprobs, tops, params):
        assert lp is None or math.isfinite(lp)
        if top is None:
            continue
        best, asked = split_top_logprobs(top, p)  # token_ids_logprob after the top-n
        assert len(best) == min(p.logprobs or 0, VOCAB), (best, p.logprobs)
        assert all(0 <= t < VOCAB and math.isfinite(v) for t, v in best)
        assert [t for t, _ in asked] == p.token_ids_logprob
        assert all(math.isfinite(v) and v <= 0 for _, v in asked)


class AllowedSet:
    """A grammar that allows a fixed set of ids (structured output's matcher, runner/
    grammar.py, as the sampler sees it); the mask may be shorter than the logits."""

    def __init__(self, ids: set[int]):
        self.ids = ids
        self.mask = torch.tensor([i in ids for i in range(VOCAB)])

    def allowed(self):
        return self.mask

    def accept(self, token):
        assert token in self.ids, (token, self.ids)


class Thinking(AllowedSet):
    """A grammar waiting out a thinking section (runner/sampling/grammar.py ThinkingGate): no mask."""

    def __init__(self):
        super().__init__(set(range(VOCAB)))

    def allowed(self):
        return None


def _states(reqs, grammars):
    states = [SamplingState(p, prompt, list(out)) for p, prompt, out in reqs]
    for s, g in zip(states, grammars):
        s.grammar = g
    return states


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(reqs=st.lists(request, min_size=1, max_size=4), data=st.data(),
       padded=st.integers(0, 3))
def test_any_valid_params_sample_inside_the_vocabulary(reqs, data, padded):
    for p, _, _ in reqs:
        if p.logprobs is not None:  # SGLang's token_ids_logprob, ids past the vocab too
            p.token_ids_logprob = data.draw(st.lists(st.integers(0, 2 * VOCAB), max_size=3))
        p.validate()
    # structured output on some rows: every drawn token must be one the grammar allows,
    # whatever the logits (all of its tokens at -inf or NaN too)
    grammars = [data.draw(st.one_of(st.none(), st.builds(Thinking), st.builds(AllowedSet, st.sets(
        st.integers(0, VOCAB - 1), min_size=1, max_size=5)))) for _ in reqs]
    rows = [data.draw(st.lists(values, min_size=VOCAB + padded, max_size=VOCAB + padded))
            for _ in reqs]
    logits = torch.tensor(rows, dtype=torch.float32)
    r = Sampler(VOCAB, [0])(logits, _states(reqs, grammars))
    _check(r.token_ids, r.logprobs, r.top_logprobs, [p for p, _, _ in reqs])
    for t, g in zip(r.token_ids, grammars):
        assert g is None or t in g.ids, (t, g.ids)
    # verification of a two-token draft from the same rows (each request's node rows)
    drafts = [[data.draw(st.integers(0, VOCAB - 1)) for _ in range(2)] for _ in reqs]
    node_rows = [logits[i:i + 1, :VOCAB].expand(3, VOCAB).contiguous()
                 for i in range(len(reqs))]
    results, _ = verify(Sampler(VOCAB, [0]), node_rows, _states(reqs, grammars), drafts)
    for produced, (p, _, _), g in zip(results, reqs, grammars):
        _check([t for t, _, _ in produced], [lp for _, lp, _ in produced],
               [top for _, _, top in produced], [p] * len(produced))
        assert g is None or all(t in g.ids for t, _, _ in produced), (produced, g.ids)
