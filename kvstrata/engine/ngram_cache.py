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
"""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from kvstrata.protocol.scheduler_output import TreeDraft


class _Node:
    __slots__ = ("children", "count", "tick", "depth")

    def __init__(self, depth: int):
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.tick = 0
        self.depth = depth


class NgramCache:
    def __init__(self, branch_length: int = 18, min_window: int = 1, max_window: int = 12,
                 capacity: int = 10_000_000):
        if branch_length < 2:
            raise ValueError("--speculative-ngram-branch-length must be >= 2")
        self.branch_length = branch_length
        self.min_window = min_window
        self.max_window = max_window
        self.capacity = capacity
        self.root = _Node(0)
        self.num_nodes = 0
        self._tick = 0
        self._suffixes: dict[str, list[_Node]] = {}  # rid -> its current suffix nodes

    # ------------------------------------------------------------------ insertion
    def extend(self, rid: str, tokens: list[int]) -> None:
        """Append `tokens` to request `rid`'s sequence (its prompt first, then outputs)."""
        frontier = self._suffixes.get(rid, [])
        limit = self.branch_length
        for t in tokens:
            self._tick += 1
            nxt = []
            for node in (self.root, *frontier):
                if node.depth >= limit:
                    continue
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node(node.depth + 1)
                    self.num_nodes += 1
                child.count += 1
                child.tick = self._tick
                nxt.append(child)
            frontier = nxt
        self._suffixes[rid] = frontier
        if self.num_nodes > self.capacity:
            self._prune()

    def forget(self, rid: str) -> None:
        self._suffixes.pop(rid, None)

    # ------------------------------------------------------------------ drafting
    def draft(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` likely next tokens after `tokens` ([] when nothing matches)."""
        out: list[int] = []
        while len(out) < max_tokens:
            node = self._longest_match(tokens, out)
            if node is None:
                break
            while node.children and len(out) < max_tokens:
                token, node = max(node.children.items(),
                                  key=lambda kv: (kv[1].count, kv[1].tick))
                out.append(token)
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
                    kids = heapq.nlargest(max(1, int(breadth)), trie.children.items(),
                                          key=lambda kv: kv[1].tick)
                    for token, sub in kids:
                        pos = child(parent, token)
                        if pos is not None:
                            queue.append((pos, breadth - step, sub))
        return _breadth_first(tree, tokens_of)

    @staticmethod
    def _grow_prob(matches, child, full, top_k: int) -> None:
        heap: list = []
        seq = 0

        def push(parent: int, trie: _Node, prob: float) -> None:
            nonlocal seq
            kids = heapq.nlargest(top_k, trie.children.items(),
                                  key=lambda kv: (kv[1].count, kv[1].tick))
            total = sum(c.count for _, c in kids) or 1
            for token, sub in kids:
                seq += 1
                heapq.heappush(heap, (-sub.count / total * prob, seq, parent, token, sub))

        for node, _ in matches:
            push(0, node, 1.0)
            while heap and not full():
                neg, _, parent, token, sub = heapq.heappop(heap)
                pos = child(parent, token)
                if pos is not None:
                    push(pos, sub, -neg)

    def _matches(self, tokens: list[int]) -> Iterator[tuple[_Node, int]]:
        """(trie node, window) of every suffix of `tokens` within the windows that is a
        path of the trie, longest first (lazily: a chain draft stops at the first)."""
        for w in range(min(self.max_window, len(tokens)), self.min_window - 1, -1):
            node = self.root
            for t in tokens[-w:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None:
                yield node, w

    def _longest_match(self, tokens: list[int], drafted: list[int]) -> _Node | None:
        seq = tokens[-self.max_window:] + drafted if drafted else tokens[-self.max_window:]
        return next((node for node, _ in self._matches(seq) if node.children), None)

    # ------------------------------------------------------------------ capacity
    def _prune(self) -> None:
        ticks = sorted(self._iter_ticks())
        cutoff = ticks[len(ticks) // 2]
        removed = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for t, child in list(node.children.items()):
                if child.tick < cutoff:
                    removed += self._size(child)
                    del node.children[t]
                else:
                    stack.append(child)
        self.num_nodes -= removed

    def _iter_ticks(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node.tick
            stack.extend(node.children.values())

    @staticmethod
    def _size(node: _Node) -> int:
        n, stack = 0, [node]
        while stack:
            cur = stack.pop()
            n += 1
            stack.extend(cur.children.values())
        return n


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
