"""The NGRAM draft source (no torch): a trie of every token sequence of up to
`branch_length` tokens seen in prompts and outputs, with how often each occurred.

Insertion is incremental per request: a request keeps the trie nodes of its current suffixes
(lengths 1 .. branch_length - 1), and each new token extends every one of them by one child
(and starts a new suffix at the root), so a token costs O(branch_length) dict operations and
a prompt O(len * branch_length). A node's count is the number of times its path occurred.

Drafting (SGLang's match-window semantics, chain form): the longest suffix of the sequence,
between `min_window` and `max_window` tokens, whose path exists in the trie and has a
continuation; from there the most frequent child, repeatedly (ties: the most recently seen).
When the trie path ends before the draft is long enough, the suffix is matched again with the
drafted tokens appended, so a draft is not capped at branch_length - window tokens.

Capacity: past `capacity` nodes the least recently touched half is pruned (a live request's
suffix nodes are the most recent, so they survive).
"""
from __future__ import annotations


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

    def _longest_match(self, tokens: list[int], drafted: list[int]) -> _Node | None:
        seq = tokens[-self.max_window:] + drafted if drafted else tokens[-self.max_window:]
        for w in range(min(self.max_window, len(seq)), self.min_window - 1, -1):
            node = self.root
            for t in seq[-w:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node
        return None

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
