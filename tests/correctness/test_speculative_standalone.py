"""STANDALONE speculative decoding (a draft checkpoint in the runner) on tiny real models.

Greedy: output tokens equal plain greedy decoding (logprobs within LOGPROB_TOL) with the
target as its own draft (every draft should pass: the accept length checks that draft KV
is shared through radix hits and rebuilt after HiCache load-backs and retractions) and
with a different architecture of the same vocabulary as draft (most drafts fail: exactness
must not depend on them). Sampling: the output distribution equals plain sampling.
"""
from __future__ import annotations

import pytest

from kvstrata import LLM
from kvstrata.engine.sides.registry import spec_side
from tests.correctness.test_speculative import (
    abort_while_running, assert_same, assert_same_distribution, assert_stops_cut_exactly,
    drained, greedy, repeating_prompts, sample_both, stop_cases)

STEPS = 4  # drafts per verify step: num_draft_tokens = 5


def make_llm(target: str, draft: str | None, **kw) -> LLM:
    if draft is not None:  # drafts in every step (not the measured gate)
        kw = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": draft,
              "speculative_num_steps": STEPS, "speculative_disable_by_batch_size": 1 << 20,
              **kw}
    return LLM(model_path=target, skip_tokenizer_init=True, dtype="float32", **kw)


def accept_length(outs: list[dict]) -> float:
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    return tokens / steps


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    """Plain greedy references of the llama target (page size 1, a large pool)."""
    llm = make_llm(tiny_checkpoints["llama"], None, max_total_tokens=8192)
    cache: dict = {}

    def get(prompts, params):
        key = (str(prompts), str(params))
        if key not in cache:
            cache[key] = llm.generate(input_ids=prompts, sampling_params=params)
        return cache[key]
    return get


@pytest.mark.parametrize("draft,page_size,chunk", [("llama", 1, 8), ("llama", 16, None),
                                                   ("qwen3", 16, 32)])
def test_greedy_equals_plain(tiny_checkpoints, plain, draft, page_size, chunk):
    prompts = repeating_prompts()
    params = greedy(40)
    ref = plain(prompts, params)
    llm = make_llm(tiny_checkpoints["llama"], tiny_checkpoints[draft], page_size=page_size,
                   max_total_tokens=8192, chunked_prefill_size=chunk or -1)
    first, again = twice_equal_plain(llm, prompts, params, ref)
    if draft == "llama":  # its own draft: every draft passes, with or without a radix hit
        assert accept_length(first) > STEPS - 0.5 and accept_length(again) > STEPS - 0.5
    plan = llm.engine.kv_plan
    assert plan.draft_components and plan.draft_bytes_per_token > 0


def twice_equal_plain(llm: LLM, prompts, params, ref) -> tuple[list, list]:
    """Both runs' outputs (the second one on radix hits) equal plain; drafts were verified;
    the pools drain whole."""
    first = llm.generate(input_ids=prompts, sampling_params=params)
    assert_same(ref, first)
    again = llm.generate(input_ids=prompts, sampling_params=params)  # radix hits
    assert_same(ref, again)
    assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
    drained(llm)
    side = spec_side(llm.engine.scheduler)
    assert side.verify_steps > 0 and side.drafted_tokens > 0, side.load()
    return first, again


def test_retraction_starved_hicache_and_aborts(tiny_checkpoints, plain):
    """Draft KV lost with a retraction or never on the host tier is rebuilt by the draft's
    catch-up extend: a self-draft still passes nearly every draft."""
    target = tiny_checkpoints["llama"]
    check_retraction_starved_hicache_and_aborts(
        lambda **kw: make_llm(target, target, **kw), plain, STEPS - 1)


def check_retraction_starved_hicache_and_aborts(make, plain, min_accept: float) -> None:
    """`make(**engine_kw)` builds the speculative engine, `plain(prompts, params)` the
    plain references: output equal under retraction and a starved HiCache, drafts still
    accepted (accept length > min_accept), then aborts while verify steps run."""
    prompts = repeating_prompts(1)
    params = greedy(48)
    ref = plain(prompts, params)
    tight = make(page_size=4, max_total_tokens=192, chunked_prefill_size=16)
    out = tight.generate(input_ids=prompts, sampling_params=params)
    assert_same(ref, out)
    assert tight.engine.scheduler.num_retractions > 0
    assert accept_length(out) > min_accept
    drained(tight)
    hi = make(page_size=4, max_total_tokens=256, enable_hierarchical_cache=True,
              hicache_ratio=4.0, chunked_prefill_size=16)
    for _ in range(2):
        out = hi.generate(input_ids=prompts, sampling_params=params)
        assert_same(ref, out)
        assert accept_length(out) > min_accept
    assert hi.get_load()["hicache_h2d_pages"] > 0  # draft KV rebuilt after load-backs
    drained(hi)
    abort_while_running(hi)  # aborts while verify steps run


def test_stops_inside_an_accepted_run(tiny_checkpoints, plain):
    """A self-draft passes every draft, so stop tokens and max_new_tokens land inside
    accepted runs: the output is cut exactly where plain decoding stops."""
    path = tiny_checkpoints["llama"]
    prompt = repeating_prompts()[1]
    full = plain([prompt], greedy(40))[0]["output_ids"]
    cases = stop_cases(full)
    assert_stops_cut_exactly(make_llm(path, path, max_total_tokens=4096), prompt, cases,
                             plain([prompt] * len(cases), cases))


def test_sampling_distribution_matches_plain(tiny_checkpoints):
    """Temperature sampling (top-k 3, top-p): the draft is the draft model's argmax, the
    target accepts it with probability p(d) -- the first three tokens' joint distribution
    matches plain sampling (chi-square, seeded, deterministic)."""
    path = tiny_checkpoints["llama"]
    prompt = [17, 42, 99, 5, 61, 8, 250]
    n = 500
    spec = make_llm(path, path, max_total_tokens=8192)
    a, b_out = sample_both(make_llm(path, None, max_total_tokens=8192), spec, prompt, n, 2000)
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in b_out) > n // 2
    assert_same_distribution(a, b_out)
    drained(spec)


def test_long_catch_up_runs_in_chunks(tiny_checkpoints, plain, monkeypatch):
    """The draft rebuilds a first prompt CATCH_UP_CHUNK tokens a forward (5 here): the
    drafts still pass and the output is plain greedy's."""
    from kvstrata.runner.spec import standalone as draft_model
    monkeypatch.setattr(draft_model, "CATCH_UP_CHUNK", 5)
    prompts = repeating_prompts()
    params = greedy(24)
    target = tiny_checkpoints["llama"]
    llm = make_llm(target, target, page_size=4, max_total_tokens=4096)
    out = llm.generate(input_ids=prompts, sampling_params=params)
    assert_same(plain(prompts, params), out)
    assert accept_length(out) > STEPS - 1
    drained(llm)


def test_tree_drafts_equal_plain_through_retraction_and_hicache(tiny_checkpoints, plain):
    """topk 3 over 3 steps, 7 drafts a tree: a self-draft's best path is the target's
    greedy one (accept length ~3: the third level rarely makes the 7 best candidates), and
    the output equals plain greedy through radix hits, retraction and a starved HiCache."""
    target = tiny_checkpoints["llama"]
    tree = {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 8,
            "speculative_num_steps": 3}
    prompts = repeating_prompts()
    params = greedy(40)
    first, again = twice_equal_plain(
        make_llm(target, target, max_total_tokens=8192, page_size=16, **tree), prompts,
        params, plain(prompts, params))
    assert accept_length(first) > 2.5 and accept_length(again) > 2.5
    check_retraction_starved_hicache_and_aborts(
        lambda **kw: make_llm(target, target, **{**kw, **tree}), plain, 2.0)
