"""NGRAM tree drafts (SGLang's BFS and PROB trees): the target verifies every branch in one
forward (each draft attends to the context and its ancestors only, at position start +
depth), accepts a path, and the accepted drafts' KV moves to the committed positions.

The n-gram cache is taught two continuations of the same text -- the right one (the
target's greedy output) first, a corrupted copy last -- so at every corrupted position the
tree's first child (the most recent) is wrong and the right one is a later sibling: accepted
paths leave the first branch and their KV has to move. Output must equal plain greedy
(tokens, and logprobs within LOGPROB_TOL: a sibling seen by mistake would shift them), through
the paged decode kernel and the masked SDPA path, pages 1 and 16, chunked prefill and radix
hits; sampling keeps the plain distribution with several candidates per node.
"""
from __future__ import annotations

import pytest

from kvstrata.runner.spec import verify as spec_verify
from tests.correctness.test_speculative import (  # noqa: F401 - plain_refs is a fixture
    assert_same, assert_same_distribution, drained, greedy, make_llm, plain_refs,
    repeating_prompts, sample_both)

TREE = {"speculative_ngram_max_bfs_breadth": 4}


@pytest.fixture
def moves(monkeypatch) -> list:
    """Every accepted tree path whose KV had to move (a path off the first branch)."""
    seen: list = []
    real = spec_verify.move_accepted_kv

    def spy(pools, table, row, start, path):
        if path != list(range(1, len(path) + 1)):
            seen.append(list(path))
        real(pools, table, row, start, path)
    monkeypatch.setattr(spec_verify, "move_accepted_kv", spy)
    return seen


def corrupted(tokens: list[int], every: int = 5) -> list[int]:
    return [(t + 1) % 300 if i % every == every - 1 else t for i, t in enumerate(tokens)]


@pytest.mark.parametrize("tree,page_size,chunk,kernel", [
    (TREE, 16, None, "1"), (TREE, 1, 8, "0"),
    ({"speculative_ngram_match_type": "PROB", "speculative_ngram_max_bfs_breadth": 3}, 1,
     None, "1")])
def test_tree_greedy_equals_plain(tiny_checkpoints, plain_refs, moves, monkeypatch, tree,
                                  page_size, chunk, kernel):
    monkeypatch.setenv("KVSTRATA_CPU_PAGED_DECODE", kernel)
    prompts = repeating_prompts()[4:]  # random prompts: nothing to draft from themselves
    params = greedy(40)
    ref = plain_refs("llama", prompts, params)
    llm = make_llm(tiny_checkpoints["llama"], True, page_size=page_size,
                   max_total_tokens=8192, chunked_prefill_size=chunk or -1,
                   speculative_num_draft_tokens=8, **tree)
    teach = [p + r["output_ids"] for p, r in zip(prompts, ref)]
    teach += [p + corrupted(r["output_ids"]) for p, r in zip(prompts, ref)]
    llm.generate(input_ids=teach, sampling_params=greedy(1))  # right first, wrong last
    out = llm.generate(input_ids=prompts, sampling_params=params)
    assert_same(ref, out)
    assert moves, "no accepted path left the first branch: the test lost its point"
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in out)
    assert sum(o["meta_info"]["completion_tokens"] for o in out) > 3 * steps
    again = llm.generate(input_ids=prompts, sampling_params=params)  # radix hits
    assert_same(ref, again)
    assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
    drained(llm)


def test_tree_sampling_distribution_matches_plain(tiny_checkpoints, moves):
    """Sampled outputs of many requests teach the cache several continuations of the same
    prompt: nodes have several children, tried in turn by the rejection rule."""
    path = tiny_checkpoints["llama"]
    prompt = [17, 42, 99, 5, 61] * 4
    n = 600
    spec = make_llm(path, True, max_total_tokens=8192, **TREE)
    a, b_out = sample_both(make_llm(path, False, max_total_tokens=8192), spec, prompt, n, 3000)
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in b_out) > 0
    assert moves  # some accepted draft was not its node's first candidate
    assert_same_distribution(a, b_out)
    drained(spec)
