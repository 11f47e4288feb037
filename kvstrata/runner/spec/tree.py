"""Draft trees of a draft model (STANDALONE / EAGLE with --speculative-eagle-topk K > 1):
SGLang's EAGLE-2 expansion, in the runner.

After the catch-up extend, the top K tokens of its last logits are the depth-1 candidates
(score: log-probability). Then, num_steps - 1 times, the draft runs once over every
request's K frontier nodes (all at the next position, each attending to the request's
context and its own ancestors; their KV goes to scratch slots past the pool's pages, never
to a request's slots), and each fed node's top K continuations become candidates scored by
the path's summed log-probability; the K best of a request's K * K form its next frontier.
The tree is the request's best `num_nodes` candidates by score (a child never scores above
its parent, so ties broken by depth keep every chosen node's parent chosen), in breadth-
first order. An EAGLE head feeds each node its parent's output hidden state (the chain's
self-fed step, per branch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.runner.forward_batch import ForwardBatch


@dataclass
class _Cand:
    score: float
    depth: int
    parent: int  # index of the parent candidate; -1: the entry's last token
    token: int
    slot: int = -1     # scratch slot once fed
    hidden: int = -1   # row of its output hidden state in the step that fed it


def scratch_per_request(topk: int, num_steps: int) -> int:
    return topk * max(num_steps - 1, 0)


@torch.inference_mode()
def build_trees(draft, plans, num_nodes: list[int], topk: int, num_steps: int,
                scratch_base: int) -> list[tuple[list[int], list[int]]]:
    """Per plan (its extend ends just before the drafts): (tokens, parents) of a tree of
    at most num_nodes[i] drafts, parents as verify-entry indices (0: the last token)."""
    logits, carry = draft.extend(plans)
    n = len(plans)
    last_pos = [p.start + len(p.tokens) - 1 for p in plans]
    cands: list[list[_Cand]] = [[] for _ in range(n)]
    vals, ids = torch.log_softmax(logits.float(), dim=-1).topk(topk, dim=-1)
    for i in range(n):
        for v, t in zip(vals[i].tolist(), ids[i].tolist()):
            cands[i].append(_Cand(v, 1, -1, t))
    frontier = [list(range(topk)) for _ in range(n)]
    hidden_prev = carry  # rows the frontier's parents' hidden states live in
    table = draft.req_to_token.table
    per_req = scratch_per_request(topk, num_steps)
    for d in range(1, num_steps):
        tokens, keys, out_slots, positions, feed_rows = [], [], [], [], []
        fed: list[tuple[int, int]] = []  # (request, candidate index)
        for i, p in enumerate(plans):
            ctx = table[p.row, :last_pos[i] + 1]
            for k, c in enumerate(frontier[i]):
                cand = cands[i][c]
                cand.slot = scratch_base + i * per_req + (d - 1) * topk + k
                path, a = [], c
                while a >= 0:
                    path.append(cands[i][a].slot)
                    a = cands[i][a].parent
                keys.append(torch.cat([ctx, torch.tensor(path[::-1], dtype=torch.int64)]))
                tokens.append(cand.token)
                out_slots.append(cand.slot)
                positions.append(last_pos[i] + d)
                parent = cands[i][cand.parent] if cand.parent >= 0 else None
                feed_rows.append(i if parent is None else parent.hidden)
                fed.append((i, c))
        fb = ForwardBatch.build([tokens], [plans[0].row], [0], draft.device)
        fb.positions = torch.tensor(positions, dtype=torch.int64).to(draft.device)
        fb.out_slots = torch.tensor(out_slots, dtype=torch.int64).to(draft.device)
        fb.query_keys = keys
        feats = None if hidden_prev is None else hidden_prev[feed_rows]
        logits, hidden_prev = draft.tree_forward(fb, feats)
        vals, ids = torch.log_softmax(logits.float(), dim=-1).topk(topk, dim=-1)
        children: list[list[int]] = [[] for _ in range(n)]
        for row, (i, c) in enumerate(fed):
            cands[i][c].hidden = row
            base = cands[i][c]
            for v, t in zip(vals[row].tolist(), ids[row].tolist()):
                children[i].append(len(cands[i]))
                cands[i].append(_Cand(base.score + v, d + 1, c, t))
        frontier = [sorted(ch, key=lambda j, i=i: -cands[i][j].score)[:topk]
                    for i, ch in enumerate(children)]
    return [_select(cands[i], num_nodes[i]) for i in range(n)]


def _select(cands: list[_Cand], num_nodes: int) -> tuple[list[int], list[int]]:
    best = sorted(range(len(cands)), key=lambda j: (-cands[j].score, cands[j].depth, j))
    chosen = sorted(best[:num_nodes], key=lambda j: (cands[j].depth, best.index(j)))
    entry = {c: e + 1 for e, c in enumerate(chosen)}
    tokens = [cands[c].token for c in chosen]
    parents = [0 if cands[c].parent < 0 else entry[cands[c].parent] for c in chosen]
    return tokens, parents
