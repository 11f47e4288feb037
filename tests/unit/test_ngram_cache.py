"""The NGRAM draft source: what it proposes, that incremental insertion equals inserting
whole sequences, and that capacity pruning keeps live suffixes."""
from __future__ import annotations

import random

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.engine.sides.ngram_cache import NgramCache
from kvstrata.protocol.scheduler_output import TreeDraft


def test_drafts_the_continuation_seen_before():
    c = NgramCache(branch_length=8, max_window=3)
    c.extend("a", [1, 2, 3, 4, 5, 6, 7])
    assert c.draft([9, 2, 3], 4) == [4, 5, 6, 7]
    assert c.draft([9, 9, 9], 4) == []       # nothing matches
    assert c.draft([1, 2, 3], 0) == []


def test_longest_match_wins_and_frequency_breaks_ties():
    c = NgramCache(branch_length=6, max_window=3)
    c.extend("a", [1, 2, 3, 7, 0, 2, 3, 8, 5, 2, 3, 8])  # "2 3" -> 8 twice, 7 once
    assert c.draft([4, 2, 3], 1) == [8]
    assert c.draft([1, 2, 3], 1) == [7]  # the 3-token match "1 2 3" is longer


def test_drafts_longer_than_the_branch_rematch():
    c = NgramCache(branch_length=3, max_window=2)
    c.extend("a", [5, 6] * 10)
    assert c.draft([5], 7) == [6, 5, 6, 5, 6, 5, 6]


def test_requests_share_the_cache_and_forget_only_their_suffixes():
    c = NgramCache(branch_length=4, max_window=2)
    c.extend("a", [1, 2, 3])
    c.extend("b", [7, 1, 2])
    assert c.draft([1, 2], 1) == [3]
    c.forget("a")
    assert c.draft([1, 2], 1) == [3]  # what a taught stays


def test_bfs_tree_follows_sglangs_breadth_and_recency():
    """Matches "2 3" (window 2) and "3": breadth (3 - 2) * 1.0 + 1 = 2 at the root, one
    less per level; the most recently seen child first."""
    c = NgramCache(branch_length=8, min_window=1, max_window=3)
    c.extend("a", [1, 2, 3, 4, 5])
    c.extend("b", [1, 2, 3, 7, 8])  # more recent: 7 before 4
    t = c.draft_tree([9, 2, 3], 6, min_breadth=1, max_breadth=4)
    assert (list(t), t.parents, t.depth()) == ([7, 4, 8, 5], [0, 0, 1, 2], 2)
    t = c.draft_tree([9, 2, 3], 6, 1, 4, max_depth=1)
    assert (list(t), t.parents) == ([7, 4], [0, 0])
    t = c.draft_tree([9, 2, 3], 3, 1, 4)  # full after three nodes, still breadth-first
    assert (list(t), t.parents) == ([7, 4, 8], [0, 0, 1])
    assert list(c.draft_tree([9, 9], 4, 1, 4)) == []


def test_prob_tree_is_best_first_by_path_frequency():
    c = NgramCache(branch_length=8, min_window=1, max_window=2)
    c.extend("a", [1, 2, 3, 4, 5, 0, 2, 3, 4, 6])  # "2 3" -> 4 twice, then 5 / 6
    c.extend("b", [2, 3, 7])                       # "2 3" -> 7 once
    # 4 (2/3); then 7, 6, 5 (1/3 each): ties in push order, children by (count, recency)
    t = c.draft_tree([2, 3], 3, 1, 2, "PROB")
    assert (list(t), t.parents) == ([4, 7, 6], [0, 0, 1])


def test_a_tree_draft_cuts_to_a_prefix_and_checks_its_parents():
    t = TreeDraft([5, 6, 7], [0, 0, 1])
    cut = t[:2]
    assert isinstance(cut, TreeDraft) and (list(cut), cut.parents) == ([5, 6], [0, 0])
    assert t[2] == 7 and t.depth() == 2
    with pytest.raises(ValueError, match="invalid draft tree parents"):
        TreeDraft([5, 6], [0, 2])


def _counts(cache: NgramCache) -> dict:
    return cache.counts()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=40), st.integers(1, 39), st.integers(2, 6))
def test_incremental_insertion_equals_whole_sequence(seq, cut, branch):
    whole, parts = NgramCache(branch), NgramCache(branch)
    whole.extend("r", seq)
    parts.extend("r", seq[:cut])
    parts.extend("r", seq[cut:])
    assert _counts(whole) == _counts(parts)
    # every substring of length <= branch is counted once per occurrence
    want: dict = {}
    for i in range(len(seq)):
        for j in range(i + 1, min(i + branch, len(seq)) + 1):
            want[tuple(seq[i:j])] = want.get(tuple(seq[i:j]), 0) + 1
    assert _counts(whole) == want


def test_capacity_prunes_old_nodes_and_keeps_recent_ones():
    rng = random.Random(0)
    c = NgramCache(branch_length=4, max_window=3, capacity=500)
    for i in range(50):
        c.extend(f"r{i}", [rng.randrange(1000) for _ in range(30)])
    assert c.num_nodes <= 500
    assert c.num_nodes == len(_counts(c))
    c.extend("live", [1, 2, 3, 4, 1, 2, 3])
    assert c.draft([9, 1, 2], 1) == [3]


def test_the_trie_holds_no_objects_the_cycle_collector_walks():
    """Nodes are indices into flat arrays and the edges one dict of ints, so a big trie adds
    nothing to Python's garbage collections (a node object + children dict each made a full
    collection walk the whole trie: ~1 s at 800k nodes, a stall of the scheduler loop)."""
    import gc
    rng = random.Random(1)
    c = NgramCache()
    c.extend("warm", [1, 2, 3])
    gc.collect()
    before = len(gc.get_objects())
    for i in range(20):
        c.extend(f"r{i}", [rng.randrange(50_000) for _ in range(200)])
    assert c.num_nodes > 50_000
    assert len(gc.get_objects()) - before < 200  # the per-request suffix lists only
    assert not gc.is_tracked(c._edge)
    with pytest.raises(ValueError, match="token id"):
        c.extend("bad", [1 << 24])


def test_pruning_keeps_live_suffixes_usable():
    """After a prune the node ids change: a live request's suffixes are mapped to the new
    ids (or dropped with their pruned nodes), so its next tokens extend nodes of the trie,
    never a stale id: every stored n-gram's prefix is stored, the node count is exact."""
    c = NgramCache(branch_length=3, max_window=2, capacity=60)
    c.extend("live", [7, 8])
    rng = random.Random(2)
    for i in range(10):
        c.extend(f"r{i}", [rng.randrange(100, 10_000) for _ in range(20)])  # forces prunes
        c.extend("live", [7, 8])                                             # stays recent
        counts = c.counts()
        assert c.num_nodes <= 60 and c.num_nodes == len(counts)
        assert all(path[:-1] in counts for path in counts if len(path) > 1)
    c.extend("live", [7, 8])
    assert c.draft([5, 8], 2) == [7, 8]
    assert c.counts()[(8, 7, 8)] >= 1  # the live request's suffix "8" was extended


def spec_config(algorithm: str, num_draft_tokens: int, **extra):
    from types import SimpleNamespace
    return SimpleNamespace(speculative_algorithm=algorithm,
                           speculative_num_draft_tokens=num_draft_tokens,
                           speculative_ngram_branch_length=18,
                           speculative_ngram_min_match_window_size=1,
                           speculative_ngram_max_match_window_size=12,
                           speculative_ngram_capacity=1000,
                           speculative_ngram_min_bfs_breadth=1,
                           speculative_ngram_max_bfs_breadth=1,
                           speculative_ngram_match_type="BFS", **extra)


def test_draft_budget_shrinks_on_misses_and_grows_on_full_accepts():
    from types import SimpleNamespace

    from kvstrata.engine.sides.speculative import MIN_BUDGET, SpeculativeSide
    side = SpeculativeSide(SimpleNamespace(config=spec_config("NGRAM", 9)))
    req = SimpleNamespace(rid="r", prompt_ids=[1, 2, 3, 4] * 5, output_ids=[],
                          params=SimpleNamespace(max_new_tokens=50), spec_verify_ct=0,
                          spec_draft_tokens=0, spec_accepted_drafts=0)
    req.all_ids = req.prompt_ids
    side.take(req)
    assert len(side.draft(req, 100)) == 8             # num_draft_tokens - 1
    side.on_verified(req, 8, 4)                        # 3 accepted: keep
    assert len(side.draft(req, 100)) == 8
    side.on_verified(req, 8, 1)                        # nothing accepted: halve
    assert len(side.draft(req, 100)) == 4
    for _ in range(3):
        side.on_verified(req, 4, 1)
    assert len(side.draft(req, 100)) == MIN_BUDGET
    side.on_verified(req, 1, 2)                        # all accepted: double
    assert len(side.draft(req, 100)) == 2
    assert req.spec_verify_ct == 6 and req.spec_accepted_drafts == 4


def test_gate_probe_steps_let_a_few_requests_draft_one_token_each():
    """In the measured gate's warm-up / exploration drafting steps only a few requests
    draft, one token each (STANDALONE: one request, one placeholder), rotating through the
    batch; a step the gate lets draft for real gives full budgets."""
    from types import SimpleNamespace

    from kvstrata.engine.sides.speculative import PROBE_REQUESTS_DRAFT_MODEL, SpeculativeSide
    from kvstrata.protocol.scheduler_output import RUNNER_DRAFT
    cfg = spec_config("STANDALONE", 4)
    side = SpeculativeSide(SimpleNamespace(config=cfg))
    reqs = [SimpleNamespace(rid=f"r{i}", prompt_ids=[5], all_ids=[5],
                            params=SimpleNamespace(max_new_tokens=50)) for i in range(16)]
    drafted_by_step = []
    for _ in range(2):  # warm-up steps of batch 16: probes
        side.begin_decode(len(reqs))
        assert side.gate.probing
        drafts = {r.rid: side.draft(r, 100) for r in reqs}
        drafted = {rid for rid, d in drafts.items() if d}
        assert len(drafted) == PROBE_REQUESTS_DRAFT_MODEL
        assert all(d == [RUNNER_DRAFT] for d in drafts.values() if d)
        drafted_by_step.append(drafted)
    assert drafted_by_step[0] != drafted_by_step[1]  # rotates
    fixed = SpeculativeSide(SimpleNamespace(config=spec_config(
        "STANDALONE", 4, speculative_disable_by_batch_size=64)))
    fixed.begin_decode(len(reqs))
    assert not fixed.gate.probing
    assert all(fixed.draft(r, 100) == [RUNNER_DRAFT] * 3 for r in reqs)


def test_a_request_rate_estimate_decays_toward_the_population_while_it_does_not_draft():
    """A request that stopped drafting after misses is not stuck plain: its own rate counts
    less each step it does not draft (IDLE_DECAY), pulled toward every request's recent rate,
    so once the population accepts above the gate's bar it drafts again; a new request starts
    at the population's rate."""
    from types import SimpleNamespace

    from kvstrata.engine.sides.speculative import IDLE_DECAY, PRIOR_RATE, SpeculativeSide
    side = SpeculativeSide(SimpleNamespace(config=spec_config("STANDALONE", 4)))
    assert side.expected_rate("new") == PRIOR_RATE

    def req(rid):
        return SimpleNamespace(rid=rid, prompt_ids=[5], all_ids=[5], spec_verify_ct=0,
                               spec_draft_tokens=0, spec_accepted_drafts=0,
                               params=SimpleNamespace(max_new_tokens=50))
    good, bad = req("good"), req("bad")
    for _ in range(40):  # the population accepts nearly everything ...
        side.begin_decode(2)
        side.on_verified(good, 3, 4)
    for _ in range(3):  # ... one request just missed everything
        side.on_verified(bad, 3, 1)
    pop = side.expected_rate("another new one")
    assert pop > 0.8 and side.expected_rate("good") > 0.9
    low = side.expected_rate("bad")
    assert low < 0.2
    side._need = 0.6  # a bar between the two: "bad" stays plain for a while, then retries
    idle = 0
    while side.expected_rate("bad") < side._need:
        side._decode_steps += 1
        idle += 1
        assert side.draft(bad, 10) == [] and idle < 50
    assert side.draft(bad, 10) != []
    # the decay is geometric in the steps without a draft (the first one is free)
    expect = pop + (low - pop) * IDLE_DECAY ** (idle - 1)
    assert abs(side.expected_rate("bad") - expect) < 1e-9


def test_a_fully_accepted_draft_grows_to_the_length_that_pays_at_the_measured_rho():
    """After a fully accepted draft the budget doubles (as before) or, where the gate has
    measured that a position is cheap (rho ~0.02-0.07 at batch 1), jumps at once to the
    draft length that pays best for the request's acceptance rate; where a position is dear
    it keeps doubling; with no measured rho (a fixed gate) it doubles."""
    from types import SimpleNamespace

    from kvstrata.engine.sides.speculative import SpeculativeSide

    def run(rho, history):
        side = SpeculativeSide(SimpleNamespace(config=spec_config("NGRAM", 9)))
        if rho is not None:
            side.gate.begin = lambda batch: rho
        req = SimpleNamespace(rid="r", prompt_ids=[1, 2, 3, 4] * 5, output_ids=[],
                              params=SimpleNamespace(max_new_tokens=50), spec_verify_ct=0,
                              spec_draft_tokens=0, spec_accepted_drafts=0)
        req.all_ids = req.prompt_ids
        side.take(req)
        for drafted, accepted in history:
            side.begin_decode(1)
            assert len(side.draft(req, 100)) == drafted
            side.on_verified(req, drafted, accepted + 1)
        side.begin_decode(1)
        return len(side.draft(req, 100))

    # 8 right, then 8 wrong (halve to 4), 4 wrong (2), 2 wrong (1), then 1 right:
    misses = [(8, 8), (8, 0), (4, 0), (2, 0), (1, 1)]
    assert run(None, misses) == 2          # fixed gate: doubles
    assert run(0.02, misses) >= 4          # cheap positions: straight to a long draft
    assert run(0.02, [(8, 8)] * 3) == 8    # and never above num_draft_tokens - 1
    side = SpeculativeSide(SimpleNamespace(config=spec_config("NGRAM", 9)))
    side._need = 0.6                       # a position costs most of a token: 1 (doubling)
    assert side._paying_budget(0.7, 8) == 1
    side._need = 0.02
    assert side._paying_budget(0.7, 8) >= 4 and side._paying_budget(0.99, 8) == 8
    side._need = float("inf")              # a step that does not draft
    assert side._paying_budget(0.99, 8) == 1
