"""The NGRAM draft source (no torch): a trie of every token sequence of up to
`branch_length` tokens seen in prompts and outputs, with how often each occurred.

Insertion is incremental per request: a request keeps the trie nodes of its current suffixes
(lengths 1 .. branch_length - 1), and each new token extends every one of them by one child
(and starts a new suffix at the root), so a token costs O(branch_length) dict operations and
a prompt O(len * branch_length). A node's count is the number of times its path occurred.

Drafting, chain form (one candidate per position, `--speculative-ngram-max-bfs-breadth 1`
with BFS matching): the longest suffix of the sequence,
between `min_window` and `max_window` tokens, whose path exists in the trie and has a
continuation; from there the most frequent child, repeatedly (ties: the most recently seen).
When the trie path ends before the draft is long enough, the suffix is matched again with the
drafted tokens appended, so a draft is not capped at branch_length - window tokens.

Drafting, tree form (`draft_tree`: a breadth above 1, or PROB matching): SGLang's BFS / PROB
trees, see there.

Capacity: past `capacity` nodes the least recently touched half is pruned (a live request's
suffix nodes are the most recent, so they survive).

Storage: no object per node. A node is an index into flat int64 arrays (token, count, tick,
first child, next sibling) and the edges are one dict of int keys (parent << 24 |
token) -> child. Neither is tracked by Python's cycle collector: with a node object and a
children dict per node (the first version) a full collection walked the whole trie -- ~1 s
at 800k nodes, a stall of the scheduler loop, and inserting fresh prompts cost 10-50 us a
token, most of it in collections the allocations triggered; it is ~5 us now.
"""
from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Iterator

from kvstrata.protocol.scheduler_output import TreeDraft

TOKEN_BITS = 24  # an edge key is parent << TOKEN_BITS | token: token ids below 2^24
ROOT = 0


class NgramCache:
    def __init__(self, branch_length: int = 18, min_window: int = 1, max_window: int = 12,
                 capacity: int = 10_000_000):
        if branch_length < 2:
            raise ValueError("--speculative-ngram-branch-length must be >= 2")
        self.branch_length = branch_length
        self.min_window = min_window
        self.max_window = max_window
        self.capacity = capacity
        self._clear()
        self._tick = 0
        self._suffixes: dict[str, list[int]] = {}  # rid -> its current suffix nodes

    def _clear(self) -> None:
        self._edge: dict[int, int] = {}
        self._token, self._count, self._last = array("q", [0]), array("q", [0]), array("q", [0])
        self._first, self._next = array("q", [-1]), array("q", [-1])
        self.num_nodes = 0  # besides the root

    def _children(self, node: int) -> Iterator[int]:
        child, nxt = self._first[node], self._next
        while child >= 0:
            yield child
            child = nxt[child]

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every stored n-gram (a path from the root) and how often it occurred."""
        out, stack = {}, [((), ROOT)]
        while stack:
            path, node = stack.pop()
            for child in self._children(node):
                key = path + (self._token[child],)
                out[key] = self._count[child]
                stack.append((key, child))
        return out

    # ------------------------------------------------------------------ insertion
    def extend(self, rid: str, tokens: list[int]) -> None:
        """Append `tokens` to request `rid`'s sequence (its prompt first, then outputs)."""
        # (ROOT, *frontier) holds one node per depth 0 .. len(frontier), so the child made
        # from the j-th has depth j + 1: the first branch_length - 1 children are the next
        # frontier (a node at the branch length takes no children).
        frontier = self._suffixes.get(rid, [])
        keep = self.branch_length - 1
        edge, count, last, first, nxt_sib = (self._edge, self._count, self._last,
                                             self._first, self._next)
        new_token, new_count, new_last = (self._token.append, count.append, last.append)
        new_first, new_next = first.append, nxt_sib.append
        tick, n = self._tick, len(self._token)
        for t in tokens:
            if not 0 <= t < 1 << TOKEN_BITS:
                raise ValueError(f"token id {t} outside [0, 2^{TOKEN_BITS})")
            tick += 1
            nxt = []
            for node in (ROOT, *frontier):
                key = node << TOKEN_BITS | t
                child = edge.get(key)
                if child is None:
                    child = edge[key] = n
                    n += 1
                    new_token(t)
                    new_count(1)
                    new_last(tick)
                    new_first(-1)
                    new_next(first[node])
                    first[node] = child
                else:
                    count[child] += 1
                    last[child] = tick
                nxt.append(child)
            frontier = nxt[:keep] if len(nxt) > keep else nxt
        self.num_nodes = n - 1
        self._tick = tick
        self._suffixes[rid] = frontier
        if self.num_nodes > self.capacity:
            self._prune()

    def forget(self, rid: str) -> None:
        self._suffixes.pop(rid, None)

    # ------------------------------------------------------------------ drafting
    def draft(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` likely next tokens after `tokens` ([] when nothing matches)."""
        out: list[int] = []
        count, last, first = self._count, self._last, self._first
        while len(out) < max_tokens:
            node = self._longest_match(tokens, out)
            if node is None:
                break
            while first[node] >= 0 and len(out) < max_tokens:
                node = max(self._children(node), key=lambda c: (count[c], last[c]))
                out.append(self._token[node])
        return out

    def draft_tree(self, tokens: list[int], max_tokens: int, min_breadth: int,
                   max_breadth: int, match_type: str = "BFS",
                   max_depth: int | None = None) -> TreeDraft:
        """Up to `max_tokens` draft tokens as a tree (SGLang's NGRAM semantics). Every
        suffix of `tokens` between the windows that is a trie path is a match, longest
        first; each match's continuations are merged into one tree until it is full:
          BFS   breadth-first from the match, the most recently seen children first, as
                many per node as a breadth that starts at min_breadth for a match of the
                whole max window, grows by (max_breadth - min_breadth) / (window range + 1)
                per token the match is shorter, and shrinks by that step per level;
          PROB  best-first by the path's probability (child count / sum of the counts of
                the node's max_breadth most frequent children, multiplied along the path).
        """
        tree: list[dict[int, int]] = [{}]  # node -> {token: child node}; node 0 the root
        tokens_of: list[int] = [0]
        depth = [0]
        deepest = max_tokens if max_depth is None else max_depth

        def child(parent: int, token: int) -> int | None:
            """The node for `token` under `parent` (new if there is room; None: none)."""
            pos = tree[parent].get(token)
            if pos is None and len(tree) <= max_tokens and depth[parent] < deepest:
                pos = tree[parent][token] = len(tree)
                tree.append({})
                tokens_of.append(token)
                depth.append(depth[parent] + 1)
            return pos

        matches = self._matches(tokens)
        if match_type == "PROB":
            self._grow_prob(matches, child, lambda: len(tree) > max_tokens, max_breadth)
        else:
            span = self.max_window - self.min_window + 1
            step = (max_breadth - min_breadth) / span
            for node, w in matches:
                queue = deque([(0, (self.max_window - w) * step + min_breadth, node)])
                while queue and len(tree) <= max_tokens:
                    parent, breadth, trie = queue.popleft()
                    kids = heapq.nlargest(max(1, int(breadth)), self._children(trie),
                                          key=self._last.__getitem__)
                    for sub in kids:
                        pos = child(parent, self._token[sub])
                        if pos is not None:
                            queue.append((pos, breadth - step, sub))
        return _breadth_first(tree, tokens_of)

    def _grow_prob(self, matches, child, full, top_k: int) -> None:
        heap: list = []
        seq = 0
        count, last = self._count, self._last

        def push(parent: int, trie: int, prob: float) -> None:
            nonlocal seq
            kids = heapq.nlargest(top_k, self._children(trie),
                                  key=lambda c: (count[c], last[c]))
            total = sum(count[c] for c in kids) or 1
            for sub in kids:
                seq += 1
                heapq.heappush(heap, (-count[sub] / total * prob, seq, parent,
                                      self._token[sub], sub))

        for node, _ in matches:
            push(0, node, 1.0)
            while heap and not full():
                neg, _, parent, token, sub = heapq.heappop(heap)
                pos = child(parent, token)
                if pos is not None:
                    push(pos, sub, -neg)

    def _matches(self, tokens: list[int]) -> Iterator[tuple[int, int]]:
        """(trie node, window) of every suffix of `tokens` within the windows that is a
        path of the trie, longest first (lazily: a chain draft stops at the first)."""
        edge = self._edge
        for w in range(min(self.max_window, len(tokens)), self.min_window - 1, -1):
            node: int | None = ROOT
            for t in tokens[-w:]:
                node = edge.get(node << TOKEN_BITS | t)
                if node is None:
                    break
            if node is not None:
                yield node, w

    def _longest_match(self, tokens: list[int], drafted: list[int]) -> int | None:
        seq = tokens[-self.max_window:] + drafted if drafted else tokens[-self.max_window:]
        first = self._first
        return next((node for node, _ in self._matches(seq) if first[node] >= 0), None)

    # ------------------------------------------------------------------ capacity
    def _prune(self) -> None:
        """Drop every subtree whose root was touched before the median tick; the rest is
        copied into fresh arrays (ids change: live suffixes are mapped, pruned ones dropped)."""
        last = self._last
        cutoff = sorted(last[1:])[self.num_nodes // 2]
        old = (self._token, self._count, self._last)
        old_first, old_next = self._first, self._next
        self._clear()
        new_id = {ROOT: ROOT}
        queue = deque([ROOT])
        while queue:
            node = queue.popleft()
            for child in self._children_in(old_first, old_next, node):
                if last[child] < cutoff:
                    continue
                parent, token = new_id[node], old[0][child]
                cid = new_id[child] = len(self._token)
                self._edge[parent << TOKEN_BITS | token] = cid
                for arr, src in zip((self._token, self._count, self._last), old):
                    arr.append(src[child])
                self._first.append(-1)
                self._next.append(self._first[parent])
                self._first[parent] = cid
                queue.append(child)
        self.num_nodes = len(self._token) - 1
        self._suffixes = {rid: [new_id[n] for n in nodes if n in new_id]
                          for rid, nodes in self._suffixes.items()}

    @staticmethod
    def _children_in(first: array, nxt: array, node: int) -> Iterator[int]:
        child = first[node]
        while child >= 0:
            yield child
            child = nxt[child]


def _breadth_first(tree: list[dict[int, int]], tokens_of: list[int]) -> TreeDraft:
    """The tree's nodes in breadth-first order (children in insertion order) with their
    parents as verify-entry indices (0: the root, the entry's last token)."""
    tokens, parents = [], []
    queue = deque((pos, 0) for pos in tree[0].values())
    while queue:
        pos, parent = queue.popleft()
        tokens.append(tokens_of[pos])
        parents.append(parent)
        index = len(tokens)
        queue.extend((sub, index) for sub in tree[pos].values())
    return TreeDraft(tokens, parents)
