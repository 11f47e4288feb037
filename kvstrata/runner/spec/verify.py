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
  - the row after the last draft (all accepted) is a plain draw: the bonus token;
  - trees: a node's children are tried in turn (below), and the accepted drafts' KV is
    moved to the committed positions (`move_accepted_kv`).
Draws use the sampler's uniforms (a seeded request's k-th token from (seed, k)); the accept
test has its own stream (seed ^ ACCEPT_SALT), so seeded requests stay reproducible.
"""
from __future__ import annotations

import torch

from kvstrata.runner.sampling.sampler import Sampler, SamplingState, mix_seed

ACCEPT_SALT = 0x5BEC_A11C_E97A_0D15


def _accept_uniform(s: SamplingState) -> float:
    """The accept test's uniform for the next token."""
    if s.params.seed is None:
        return float(torch.rand(()))
    return (mix_seed(s.params.seed ^ ACCEPT_SALT, len(s.output_token_ids)) >> 40) / float(1 << 24)


def _children(parents: list[int] | None, drafts: list[int]) -> dict[int, list[tuple]]:
    """Entry node -> [(child node, draft token)], in draft order (node 0 is the last token,
    node j draft j; a chain when parents is None)."""
    kids: dict[int, list[tuple]] = {}
    for j, d in enumerate(drafts):
        parent = j if parents is None else parents[j]
        kids.setdefault(parent, []).append((j + 1, d))
    return kids


def verify(sampler: Sampler, logits: list[torch.Tensor], states: list[SamplingState],
           drafts: list[list[int]], parents: list[list[int] | None] | None = None,
           thresholds: tuple[float, float] = (1.0, 1.0)
           ) -> tuple[list[list[tuple[int, float | None, list | None]]], list[list[int]]]:
    """Per request: the tokens it produced, each (token, logprob, top logprobs), and the
    accepted path (the draft nodes 1..k whose tokens were kept, in order). `logits[i]` is
    [len(drafts[i]) + 1, vocab], row j the target after entry node j. A tree node's
    children are tried in draft order: greedy moves to the child holding the argmax;
    sampling follows `_sample_children` (SGLang's rule; `thresholds` = (single, acc),
    --speculative-accept-threshold-*), which keeps the plain distribution at 1.0.
    Appends every produced token to its state."""
    kids = [_children(None if parents is None else parents[i], drafts[i])
            for i in range(len(states))]
    results: list[list[tuple]] = [[] for _ in states]
    paths: list[list[int]] = [[] for _ in states]
    node = [0] * len(states)
    alive = list(range(len(states)))
    while alive:
        rows = torch.stack([logits[i][node[i]] for i in alive])
        st = [states[i] for i in alive]
        adj = sampler.adjusted(rows, st)
        tokens = adj.argmax(dim=-1).tolist()
        sample_rows = [r for r, s in enumerate(st) if not s.params.is_greedy]
        if sample_rows:
            sub = [st[r] for r in sample_rows]
            probs = sampler.sampling_probs(adj[sample_rows], sub)
            draws = Sampler.uniforms(sub)
            for k, r in enumerate(sample_rows):
                i = alive[r]
                tokens[r] = _sample_children(probs[k], kids[i].get(node[i], ()), sub[k],
                                             draws[k:k + 1], thresholds)
        want_lp = [r for r, s in enumerate(st) if s.params.logprobs is not None]
        lps: list = [None] * len(st)
        tops: list = [None] * len(st)
        if want_lp:
            Sampler.fill_logprobs(adj, want_lp, [s.params for s in st], tokens, lps, tops)
        still = []
        for r, i in enumerate(alive):
            states[i].record(tokens[r])
            results[i].append((tokens[r], lps[r], tops[r]))
            nxt = next((c for c, d in kids[i].get(node[i], ()) if d == tokens[r]), None)
            if nxt is not None:
                node[i] = nxt
                paths[i].append(nxt)
                still.append(i)
        alive = still
    return results, paths


def _sample_children(p: torch.Tensor, children, state: SamplingState, draw: list[float],
                     thresholds: tuple[float, float] = (1.0, 1.0)) -> int:
    """One sampled row at a node whose children (drafts, one-hot) are tried in order, with
    SGLang's rule: one uniform u for the node, acc = the target probabilities of the
    children tried so far; child c is accepted iff u < acc / threshold_acc or p(c) >=
    threshold_single; else it leaves the residual. No child: a draw from the residual.
    With both thresholds 1.0, P(c) = p(c) for every child and p(x) for every other token
    (exact); below 1.0 drafts pass more often (lossy, as the flags say)."""
    single, acc_threshold = thresholds
    total = float(p.sum())
    u = _accept_uniform(state)
    acc = 0.0
    for _, d in children:
        p_d = float(p[d]) / total if d < p.shape[0] and total > 0 else 0.0
        acc += p_d
        if u < acc / max(acc_threshold, 1e-9) or p_d >= single:
            return d
        if d < p.shape[0]:
            p = p.clone()
            p[d] = 0.0
    return Sampler.inverse_cdf(p[None], draw)[0]


def move_accepted_kv(pools, table: torch.Tensor, row: int, start: int,
                     path: list[int]) -> None:
    """A tree entry's accepted drafts hold their KV at their nodes' slots (start + node);
    the committed positions are start + 1 .. start + len(path): copy it there, in every
    pool that keeps per-slot state (node_j >= j, so no source is overwritten first)."""
    if path == list(range(1, len(path) + 1)):
        return
    src = table[row, start + torch.tensor(path)]
    dst = table[row, start + 1:start + 1 + len(path)]
    for pool in pools:
        pool.copy_slots(src, dst)


def verify_entries(runner, reqs: list, token_ids: list[list[int]], logits: torch.Tensor,
                   spans: list[tuple[int, int]], states: list[SamplingState]) -> dict:
    """The runner's verify entries of one step (batch index, first logits row): accept,
    move a tree's accepted KV to the committed positions, tell the draft. rid -> the
    entry's (token, logprob, top) per produced token."""
    vreqs = [reqs[i] for i, _ in spans]
    results, paths = verify(
        runner.sampler, [logits[first:first + reqs[i].num_draft + 1] for i, first in spans],
        states, [token_ids[i][-reqs[i].num_draft:] for i, _ in spans],
        [r.draft_parents for r in vreqs], runner.spec_accept_thresholds)
    draft = runner.draft
    pools = [p for p in (runner.kv_pool, draft) if p is not None]  # (all-SWA: no kv_pool)
    swa_pool = getattr(runner, "swa_pool", None)
    for r, path in zip(vreqs, paths):
        if r.draft_parents is not None:
            move_accepted_kv(pools, runner.req_to_token.table, r.row, r.start_pos, path)
            if swa_pool is not None:  # hybrid SWA memory: the windowed layers' K/V too
                move_accepted_kv([swa_pool], runner.swa_req_to_token.table, r.row,
                                 r.start_pos, path)
    if draft is not None:
        for r, res in zip(vreqs, results):
            draft.after_verify(r.rid, r.row, r.start_pos, r.num_draft, len(res) - 1,
                               tree=r.draft_parents is not None)
    return {r.rid: res for r, res in zip(vreqs, results)}
