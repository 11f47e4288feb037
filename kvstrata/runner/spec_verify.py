"""Speculative verification: which of a request's draft tokens the target accepts.

A verify entry ran the target over [last token, d1 .. dk]; row j of its logits is the
target's distribution for the token after d1 .. dj. Positions are walked in order, each one
through the same sampler pipeline as a plain decode step (penalties and min_new_tokens see
the tokens accepted so far), and the walk stops at the first token that is not the draft:
  - greedy rows: the target's argmax; d(j+1) is accepted iff it is that argmax, so the output
    is exactly what plain greedy decoding produces;
  - sampled rows (draft q is one token, as NGRAM's): accept d with probability p(d), else
    draw from p with d removed (renormalised). P(out = d) = p(d) and P(out = x) =
    (1 - p(d)) p(x) / (1 - p(d)) = p(x): the output distribution is the plain one's (the
    speculative-sampling rule of Leviathan et al. / Chen et al. for a one-hot draft).
  - the row after the last draft (all accepted) is a plain draw: the bonus token.
Draws use the sampler's uniforms (a seeded request's k-th token from (seed, k)); the accept
test has its own stream (seed ^ ACCEPT_SALT), so seeded requests stay reproducible.
"""
from __future__ import annotations

import torch

from kvstrata.runner.sampler import Sampler, SamplingState, mix_seed

ACCEPT_SALT = 0x5BEC_A11C_E97A_0D15


def _accept_uniforms(states: list[SamplingState]) -> list[float]:
    out = []
    for s in states:
        if s.params.seed is None:
            out.append(float(torch.rand(())))
        else:
            out.append((mix_seed(s.params.seed ^ ACCEPT_SALT, len(s.output_token_ids)) >> 40)
                       / float(1 << 24))
    return out


def verify(sampler: Sampler, logits: list[torch.Tensor], states: list[SamplingState],
           drafts: list[list[int]]) -> list[list[tuple[int, float | None, list | None]]]:
    """Per request: the tokens it produced, each (token, logprob, top logprobs). `logits[i]`
    is [len(drafts[i]) + 1, vocab]. Appends every produced token to its state."""
    results: list[list[tuple]] = [[] for _ in states]
    alive = list(range(len(states)))
    j = 0
    while alive:
        rows = torch.stack([logits[i][j] for i in alive])
        st = [states[i] for i in alive]
        adj = sampler.adjusted(rows, st)
        tokens = adj.argmax(dim=-1).tolist()
        sample_rows = [r for r, s in enumerate(st) if not s.params.is_greedy]
        if sample_rows:
            sub = [st[r] for r in sample_rows]
            probs = sampler._probs(adj[sample_rows], sub)
            draws = Sampler._uniforms(sub)
            accept_u = _accept_uniforms(sub)
            for k, r in enumerate(sample_rows):
                i = alive[r]
                p = probs[k]
                if j < len(drafts[i]):
                    d = drafts[i][j]
                    total = float(p.sum())
                    p_d = float(p[d]) / total if d < p.shape[0] and total > 0 else 0.0
                    if accept_u[k] < p_d:
                        tokens[r] = d
                        continue
                    if d < p.shape[0]:
                        p = p.clone()
                        p[d] = 0.0
                tokens[r] = Sampler._inverse_cdf(p[None], draws[k:k + 1])[0]
        want_lp = [r for r, s in enumerate(st) if s.params.logprobs is not None]
        lps: list = [None] * len(st)
        tops: list = [None] * len(st)
        if want_lp:
            Sampler._fill_logprobs(adj, want_lp, [s.params for s in st], tokens, lps, tops)
        still = []
        for r, i in enumerate(alive):
            states[i].output_token_ids.append(tokens[r])
            results[i].append((tokens[r], lps[r], tops[r]))
            if j < len(drafts[i]) and tokens[r] == drafts[i][j]:
                still.append(i)
        alive = still
        j += 1
    return results
