"""Speculative decoding (NGRAM, chain drafts) on tiny real checkpoints.

Greedy: the output tokens equal plain greedy decoding of the same engine shape, and each
chosen token's logprob stays within LOGPROB_TOL (a verify step computes the same positions
through the multi-token attention path instead of the decode kernel), under page sizes 1 and
16, chunked prefill, radix hits, retraction, HiCache with a starved pool, stop tokens and
max_new_tokens landing inside an accepted run, and aborts; the pools are whole afterwards.
Sampling: the empirical distribution of the tokens produced by verify steps matches plain
sampling (chi-square, fixed seeds).
"""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from kvstrata import LLM
from kvstrata.engine.sides.registry import spec_side

LOGPROB_TOL = 1e-4
VOCAB = 300  # tests/conftest.py TINY_VOCAB


def make_llm(path: str, spec: bool, **kw) -> LLM:
    if spec:  # drafts in every step (not the measured gate): the tests count acceptances
        kw = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5,
              "speculative_disable_by_batch_size": 1 << 20, **kw}
    return LLM(model_path=path, skip_tokenizer_init=True, dtype="float32", **kw)


def repeating_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that quote themselves (the n-gram cache then has drafts from the start) and
    plain random ones of different lengths (page boundaries of 16 crossed)."""
    rng = random.Random(seed)
    out = []
    for n, reps in ((6, 4), (11, 3), (3, 6), (20, 2)):
        base = [rng.randrange(3, VOCAB) for _ in range(n)]
        out.append(base * reps)
    out += [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 17, 33)]
    return out


def greedy(max_new: int, **extra) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            **extra}


def drained(llm: LLM) -> None:
    llm.engine.check_integrity()
    sched = llm.engine.scheduler
    assert not sched.live_requests() and not sched.waiting
    kv = sched.kv
    assert kv.tree.protected_pages() == 0
    assert kv.allocator.available_pages() + kv.tree.cached_pages() == kv.allocator.num_pages


def assert_same(plain: list[dict], spec: list[dict]) -> None:
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert b["output_ids"] == a["output_ids"], f"request {i}: tokens differ"
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"], i
        la = [lp for lp, _ in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, _ in b["meta_info"]["output_token_logprobs"]]
        worst = max((abs(x - y) for x, y in zip(la, lb)), default=0.0)
        assert worst < LOGPROB_TOL, f"request {i}: a chosen token's logprob moved by {worst}"


@pytest.fixture(scope="module")
def plain_refs(tiny_checkpoints):
    """arch -> outputs of plain greedy decoding (a large pool, page size 1)."""
    cache: dict = {}

    def get(arch: str, prompts, params):
        key = (arch, str(prompts), str(params))
        if key not in cache:
            llm = cache.get(arch) or make_llm(tiny_checkpoints[arch], False,
                                               max_total_tokens=8192)
            cache[arch] = llm
            cache[key] = llm.generate(input_ids=prompts, sampling_params=params)
        return cache[key]
    return get


@pytest.mark.parametrize("arch,page_size,chunk", [("llama", 1, 8), ("llama", 16, 32),
                                                  ("qwen3", 1, None), ("qwen2", 16, None)])
def test_greedy_equals_plain(tiny_checkpoints, plain_refs, arch, page_size, chunk):
    prompts = repeating_prompts()
    params = greedy(40)
    llm = make_llm(tiny_checkpoints[arch], True, page_size=page_size, max_total_tokens=8192,
                   chunked_prefill_size=chunk or -1)
    ref = plain_refs(arch, prompts, params)
    assert_same(ref, llm.generate(input_ids=prompts, sampling_params=params))
    # Again through the same engine: radix hits on every prompt (and on outputs).
    again = llm.generate(input_ids=prompts, sampling_params=params)
    assert_same(ref, again)
    assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
    drained(llm)
    side = spec_side(llm.engine.scheduler)
    assert side.verify_steps > 0 and side.accepted_tokens > side.verify_steps, side.load()
    meta = again[0]["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] >= 1.0
    assert 0 <= meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]


@pytest.mark.parametrize("tree", [{}, {"speculative_ngram_max_bfs_breadth": 4}])
def test_retraction_and_starved_hicache(tiny_checkpoints, plain_refs, tree):
    prompts = repeating_prompts(1)
    params = greedy(48)
    ref = plain_refs("llama", prompts, params)
    # A pool too small for every request at once: decode retracts and recomputes.
    tight = make_llm(tiny_checkpoints["llama"], True, page_size=4, max_total_tokens=192,
                     chunked_prefill_size=16, **tree)
    assert_same(ref, tight.generate(input_ids=prompts, sampling_params=params))
    assert tight.engine.scheduler.num_retractions > 0
    drained(tight)
    # HiCache with a device pool that cannot hold the working set: pages go to the host
    # tier and come back as prefix hits.
    hi = make_llm(tiny_checkpoints["llama"], True, page_size=4, max_total_tokens=256,
                  enable_hierarchical_cache=True, hicache_ratio=4.0, chunked_prefill_size=16,
                  **tree)
    for _ in range(2):
        assert_same(ref, hi.generate(input_ids=prompts, sampling_params=params))
    drained(hi)
    assert spec_side(hi.engine.scheduler).accepted_tokens > 0


def test_stops_inside_an_accepted_run(tiny_checkpoints, plain_refs):
    """A stop token, or max_new_tokens, that falls inside a run of accepted drafts cuts the
    output exactly where plain decoding stops."""
    path = tiny_checkpoints["llama"]
    prompt = repeating_prompts()[0]
    full = plain_refs("llama", [prompt], greedy(40))[0]["output_ids"]
    llm = make_llm(path, True, max_total_tokens=4096)
    # The n-gram cache is shared: after one full run, the same prompt's drafts are that
    # run's tokens, so every draft is accepted and stops land inside accepted runs.
    assert llm.generate(input_ids=[prompt], sampling_params=greedy(40))[0]["output_ids"] == full
    cases = stop_cases(full)
    assert_stops_cut_exactly(llm, prompt, cases, plain_refs("llama", [prompt] * len(cases),
                                                            cases))


def stop_cases(full: list[int]) -> list[dict]:
    """max_new_tokens 1..8, stop tokens from the plain output's first tokens, EOS on."""
    cases = [greedy(n) for n in range(1, 9)]
    cases += [greedy(40, stop_token_ids=[t]) for t in sorted(set(full[1:12]))[:6]]
    return cases + [{**greedy(40, stop_token_ids=[full[5]]), "ignore_eos": False}]


def assert_stops_cut_exactly(llm: LLM, prompt: list[int], cases: list[dict],
                             ref: list[dict]) -> None:
    out = llm.generate(input_ids=[prompt] * len(cases), sampling_params=cases)
    assert_same(ref, out)
    assert all(o["meta_info"]["spec_accept_token_num"] > 0 for o in out
               if o["meta_info"]["completion_tokens"] > 2)
    drained(llm)


def test_abort_mid_run_leaves_pools_whole(tiny_checkpoints):
    llm = make_llm(tiny_checkpoints["llama"], True, page_size=4, max_total_tokens=1024)
    abort_while_running(llm)


def abort_while_running(llm: LLM) -> None:
    """Requests aborted every third step while verify steps run; the pools end whole."""
    from kvstrata.engine.request import EngineRequest
    from kvstrata.protocol import SamplingParams
    engine = llm.engine
    for i, p in enumerate(repeating_prompts(2)):
        engine.add_request(EngineRequest(f"a{i}", p, SamplingParams(
            max_new_tokens=64, temperature=0, ignore_eos=True)))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        live = engine.scheduler.live_requests()
        if steps % 3 == 0 and live:
            engine.abort_request(live[0].rid)
        assert steps < 2000
    drained(llm)


# ---------------------------------------------------------------- sampling
def _chi2_critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.29: p ~ 5e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _two_sample_chi2(a: Counter, b: Counter) -> tuple[float, int]:
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]  # sparse cells pooled
    na, nb = sum(a.values()), sum(b.values())
    rest_a = na - sum(a[k] for k in keys)
    rest_b = nb - sum(b[k] for k in keys)
    cells = [(a[k], b[k]) for k in keys] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = 0.0
    for x, y in cells:
        ex, ey = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return stat, len(cells) - 1


def test_sampling_distribution_matches_plain(tiny_checkpoints):
    """Temperature sampling with top-k/top-p: the joint distribution of the first three
    output tokens (the 2nd and 3rd come from verify steps with drafts) matches plain
    sampling. Seeded requests: the test is deterministic. The distribution is kept narrow
    (top-k 3) so drafts are often likely: accepting them twice as often as the rule says
    (measured) gives chi-square ~83 on the 2nd token against a bar of ~26."""
    path = tiny_checkpoints["llama"]
    base = [17, 42, 99, 5, 61]
    prompt = base * 4  # the n-gram cache drafts base's continuation
    n = 600
    spec = make_llm(path, True, max_total_tokens=8192)
    a, b_out = sample_both(make_llm(path, False, max_total_tokens=8192), spec, prompt, n, 1000)
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in b_out) > 0
    assert sum(o["meta_info"]["spec_draft_token_num"] for o in b_out) > n // 2
    assert_same_distribution(a, b_out)
    drained(spec)


def sample_both(plain: LLM, spec: LLM, prompt: list[int], n: int, seed: int
                ) -> tuple[Counter, list[dict]]:
    """n seeded samples of 3 tokens (temperature 0.8, top-k 3, top-p 0.95) from each engine
    (other seeds for the speculative one): the plain outputs counted, the speculative ones."""
    params = [{"max_new_tokens": 3, "temperature": 0.8, "top_k": 3, "top_p": 0.95,
               "ignore_eos": True, "seed": seed + i} for i in range(n)]
    a = Counter(tuple(o["output_ids"]) for o in plain.generate(
        input_ids=[prompt] * n, sampling_params=params))
    return a, spec.generate(input_ids=[prompt] * n, sampling_params=[
        {**p, "seed": p["seed"] + 7919} for p in params])


def assert_same_distribution(plain: Counter, spec_outs: list[dict]) -> None:
    """The speculative outputs' first tokens are distributed as the plain ones: each
    verified position on its own, then the joint (chi-square)."""
    b = Counter(tuple(o["output_ids"]) for o in spec_outs)
    for pos in (1, 2):
        stat, df = _two_sample_chi2(Counter(k[pos] for k in plain.elements()),
                                    Counter(k[pos] for k in b.elements()))
        assert stat < _chi2_critical(max(df, 1)), (pos, stat, df)
    stat, df = _two_sample_chi2(plain, b)
    assert stat < _chi2_critical(max(df, 1)), (stat, df)


# A soak (KVSTRATA_SOAK=1): NGRAM on SmolLM2 is test_deterministic_smollm2.py's case, a
# model drafting for itself at w8a8 test_speculative_standalone.py's tiny ones.
@pytest.mark.soak
def test_smollm2_gguf_ngram_and_int8_self_draft_equal_plain(smollm2_gguf_path):
    """The real model: an answer that quotes its prompt is drafted from the prompt (NGRAM)
    or by SmolLM2 itself at w8a8 (STANDALONE), accepted several tokens per step, and
    identical to plain greedy decoding."""
    passage = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen "
               "liquor jugs. How vexingly quick daft zebras jump!")
    msgs = [{"role": "user", "content": "Repeat the following text exactly:\n\n" + passage}]
    params = {"max_new_tokens": 40, "temperature": 0}
    # Drafts only in steps of one request (--speculative-disable-by-batch-size 1): the same
    # prompt twice in one batch decodes plainly, the plain reference without a third engine.
    setups = {"NGRAM": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6,
                        "speculative_disable_by_batch_size": 1},
              "STANDALONE": {"speculative_algorithm": "STANDALONE",
                             "speculative_draft_model_path": smollm2_gguf_path,
                             "speculative_draft_model_quantization": "w8a8_int8",
                             "speculative_disable_by_batch_size": 1}}
    outs = {}
    for name, kw in setups.items():
        with LLM(model_path=smollm2_gguf_path, max_total_tokens=2048, page_size=16,
                 **kw) as llm:
            prompt = llm.tokenizer.apply_chat_template(msgs, tokenize=False,
                                                       add_generation_prompt=True)
            if name == "STANDALONE":
                outs["plain"] = llm.generate([prompt, prompt], params)[0]
            outs[name] = llm.generate(prompt, params)
            drained(llm)
    plain = outs["plain"]
    assert plain["meta_info"]["spec_draft_token_num"] == 0  # decoded plainly
    for name in ("NGRAM", "STANDALONE"):
        assert outs[name]["output_ids"] == plain["output_ids"], name
        assert outs[name]["meta_info"]["spec_accept_length"] > 1.5, (name, outs[name])
    assert "quick brown fox" in plain["text"], plain["text"]
