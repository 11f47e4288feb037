"""Hybrid SWA memory end to end: kvstrata.LLM with the real scheduler, KV manager and SWA radix
cache (cache/swa_pages.py, swa_radix.py) handing the runner its SWA slots. Greedy tokens must
equal transformers' (eager) and the engine's own with --disable-hybrid-swa-memory; every KV
invariant is checked after every step (KVSTRATA_CHECK_INTEGRITY, tests/conftest.py) and the
pools are whole after the drain (check_integrity).

Models: test_sliding_window_models.py's tiny all-SWA Mistral (W = 8) and Qwen2 (layer 0 full).
"""
from __future__ import annotations

import pytest

from kvstrata.cache.swa_pages import SWAPages
from tests.correctness.test_sliding_window_models import (  # noqa: F401 (fixtures)
    GREEDY, check, prompts, references, windowed)
from tests.correctness.test_sliding_window_models import llm as uniform_llm


def llm(path, **kw):
    kw.setdefault("disable_hybrid_swa_memory", False)
    return uniform_llm(path, **kw)


@pytest.fixture
def swa_allocs(monkeypatch):
    """How many SWA pages the engine allocated (more than the pool holds = pages reused)."""
    count = {"pages": 0}
    alloc = SWAPages.alloc_for

    def counting(self, full_pages):
        ok = alloc(self, full_pages)
        count["pages"] += len(full_pages) if ok else 0
        return ok
    monkeypatch.setattr(SWAPages, "alloc_for", counting)
    return count


def run(engine, prompts, refs, label, again=True, hits=True):
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    check(outs, refs, label)
    if again:  # from the radix cache: hits past the window
        second = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        # (Each prompt enters the tree once prefilled (KVManager.cache_prompt): its decode
        # leaves the prompt's SWA pages cached instead of freeing them as its own.)
        assert (sum(o["meta_info"]["cached_tokens"] for o in second) > 0) or not hits, label
        check(second, refs, label + " prefix-cached")
    engine.check_integrity()
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("arch,page_size,chunk,tokens", [
    ("mistral", 1, None, 1024), ("mistral", 16, None, 1024),
    ("mistral", 1, 6, 96), ("mistral", 16, 16, 160),   # chunks across the window edge
    ("qwen2", 1, 6, 512), ("qwen2", 16, None, 1024), ("qwen2", 16, 16, 512)])
def test_engine_greedy_equals_transformers_and_uniform_pool(arch, page_size, chunk, tokens,
                                                            windowed, prompts, references,
                                                            swa_allocs):
    """Batched prompts up to ~9x the window; the smaller SWA pools (96 / 160 SWA tokens for
    7 requests of up to 94 tokens) only serve them by freeing out-of-window pages."""
    label = f"{arch} P={page_size} chunk={chunk} tokens={tokens}"
    with llm(windowed[arch], page_size=page_size, chunked_prefill_size=chunk or -1,
             max_total_tokens=tokens) as engine:
        plan = engine.server_info()["kv_plan"]
        assert plan["pool_kind"] == "swa" and plan["num_swa_pages"] > 0, plan
        # (a pool too small to keep finished prompts evicts their SWA pages: no hit)
        hybrid = run(engine, prompts, references[arch], label, hits=tokens >= 512)
        swa_tokens = plan["max_swa_tokens"]
    if swa_tokens < 200:
        assert swa_allocs["pages"] * page_size > swa_tokens, (swa_allocs, swa_tokens)
    with llm(windowed[arch], page_size=page_size, chunked_prefill_size=chunk or -1,
             max_total_tokens=4096, disable_hybrid_swa_memory=True) as engine:
        assert engine.server_info()["kv_plan"]["pool_kind"] == "mha"
        assert run(engine, prompts, references[arch], label + " uniform", again=False) == hybrid


def _generate_overlapped(engine, prompt, start_second_after: int | None):
    """Send `prompt` twice, the second copy after the first's prefill and that many decode
    steps (None: after the first finished); -> [(output ids, cached tokens)] per copy."""
    from kvstrata.protocol.engine_request import EngineRequest
    from kvstrata.protocol.sampling_params import SamplingParams

    core, params = engine.engine, SamplingParams.from_dict(GREEDY)
    out = {rid: [[], None] for rid in ("a", "b")}
    core.add_request(EngineRequest("a", list(prompt), params))
    steps, sent = 0, False
    while any(o[1] is None for o in out.values()):
        if not sent and ((start_second_after is None and out["a"][1] is not None)
                         or steps == start_second_after):
            core.add_request(EngineRequest("b", list(prompt), params))
            sent = True
        for o in core.step():
            out[o.rid][0].extend(o.new_token_ids)
            if o.finished:
                out[o.rid][1] = o.cached_tokens
        steps += 1
    return [tuple(out[rid]) for rid in ("a", "b")]


@pytest.mark.parametrize("arch,page_size", [("mistral", 1), ("mistral", 16), ("qwen2", 16)])
def test_repeated_prompt_hits_past_the_window(arch, page_size, windowed, prompts, references):
    """A long prompt (70 tokens, W = 8), unchunked, sent again once the first copy finished
    and while it still decodes (its window already past the prompt's start, so it has given
    up the SWA pages of the prompt's head): every time the second copy hits all but at most
    the last window (+ a page), with transformers' tokens."""
    prompt, ref = prompts[-1], references[arch][-1]
    floor = len(prompt) - 8 - page_size
    with llm(windowed[arch], page_size=page_size, max_total_tokens=1024) as engine:
        for label, after in (("after", None), ("during", 16)):
            (first, hit_a), (second, hit_b) = _generate_overlapped(engine, prompt, after)
            check([first, second], [ref, ref], f"{arch} P={page_size} {label}")
            assert hit_b >= floor, (label, hit_a, hit_b, floor)
            engine.flush_cache()  # each case from a cold tree
        engine.check_integrity()


def test_resolution_and_plan_in_server_info(windowed):
    with llm(windowed["qwen2"], max_total_tokens=1000, page_size=16,
             swa_full_tokens_ratio=0.5) as engine:
        info = engine.server_info()
        res = {r["field"]: r for r in info["resolutions"]}
        assert res["hybrid_swa_memory"]["rule"] == "swa.on"
        assert res["max_total_tokens"]["rule"] == "kv_plan.swa_memory"
        plan = info["kv_plan"]
        assert (plan["max_total_tokens"], plan["max_swa_tokens"]) == (992, 496)
        assert [c["num_layers"] for c in plan["components"]] == [1, 1]
        assert [c["num_layers"] for c in plan["swa_components"]] == [2, 2]


def test_ngram_speculation(windowed, prompts, references):
    """NGRAM tree drafts: verify entries over both pools, accepted K/V moved in both."""
    path = windowed["qwen2"]
    refs = references["qwen2"]
    teach = [p + r[0] for p, r in zip(prompts, refs)]
    with llm(path, max_total_tokens=2048, speculative_algorithm="NGRAM",
             speculative_num_draft_tokens=8, speculative_ngram_max_bfs_breadth=4,
             speculative_disable_by_batch_size=1 << 20) as engine:
        assert engine.server_info()["kv_plan"]["pool_kind"] == "swa"
        engine.generate(input_ids=teach, sampling_params={"max_new_tokens": 1,
                                                          "temperature": 0})
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        check(outs, refs, "qwen2 NGRAM")
        assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0
        engine.check_integrity()


def test_gemma_with_its_own_swa_pool(tmp_path):
    """Gemma 3 (5 local : 1 global) and Gemma 2 (soft-capped, alternating) with the SWA pool:
    transformers' tokens on prompts past the window (SGLang keeps Gemma on one pool)."""
    import random

    from helpers.gemma_ckpt import GEMMAS, build_gemma_checkpoint, hf_gemma, hf_greedy

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (4, 30, 61)]
    for arch in GEMMAS:
        path = build_gemma_checkpoint(arch, str(tmp_path / arch))
        refs = hf_greedy(hf_gemma(path), prompts, GREEDY["max_new_tokens"])
        with llm(path, max_total_tokens=1024, page_size=16, chunked_prefill_size=16) as engine:
            assert engine.server_info()["kv_plan"]["pool_kind"] == "swa", arch
            run(engine, prompts, refs, arch, hits=True)


def test_starved_pools_with_hicache(windowed):
    """HiCache L2 with the SWA pool (cache/swa_hiradix.py): multi-turn prompts through a
    device pool of 96 full / 48 SWA tokens, so prefixes are demoted to the host (both halves)
    and loaded back; the tokens equal --disable-hybrid-swa-memory's on a large pool (which
    test_sliding_window_models.py ties to transformers) and every pool, the host's included,
    is whole after the drain (check_integrity after every step, KVSTRATA_CHECK_INTEGRITY)."""
    from helpers.compare import assert_match_transformers

    from tests.correctness.test_hicache_engine import multi_turn

    path = windowed["qwen2"]
    with llm(path, page_size=4, chunked_prefill_size=16, max_total_tokens=4096,
             disable_hybrid_swa_memory=True) as engine:
        prompts, expected = multi_turn(engine, conversations=3, turns=4, system_len=20,
                                       user_len=6)
    assert_match_transformers(path, prompts, expected, label="uniform pool vs transformers")
    with llm(path, page_size=4, chunked_prefill_size=16, max_total_tokens=96,
             swa_full_tokens_ratio=0.5, enable_hierarchical_cache=True, hicache_size=0,
             hicache_ratio=8.0) as engine:
        info = engine.server_info()
        assert info["kv_plan"]["pool_kind"] == "swa" and info["kv_plan"]["num_host_pages"] > 0
        got = multi_turn(engine, conversations=3, turns=4, system_len=20, user_len=6)
        assert got == (prompts, expected)
        load = engine.get_load()
        assert load["hicache_demoted_pages"] > 0 and load["hicache_host_hit_tokens"] > 0, load
        engine.check_integrity()


def test_tensor_parallel(windowed, prompts, references):
    """tp 2: every rank builds the same SWA pool from the one plan (its heads' share) and
    applies the same ScheduledRequest.swa_slots; transformers' tokens, prefix hits included."""
    with llm(windowed["qwen2"], tp_size=2, page_size=16, max_total_tokens=1024) as engine:
        assert engine.server_info()["kv_plan"]["pool_kind"] == "swa"
        run(engine, prompts, references["qwen2"], "qwen2 tp 2")


@pytest.fixture(scope="module")
def heads(windowed, tmp_path_factory) -> dict:
    """Random EAGLE-2 / EAGLE-3 heads for the windowed targets (most drafts fail: exactness
    must not depend on them)."""
    from tests.helpers.eagle_heads import random_eagle3_head, random_head

    root = tmp_path_factory.mktemp("swa_heads")
    return {("qwen2", "EAGLE"): random_head(windowed["qwen2"], str(root / "qwen2_eagle"))[0],
            ("qwen2", "EAGLE3"): random_eagle3_head(windowed["qwen2"],
                                                    str(root / "qwen2_eagle3"))[0],
            ("mistral", "EAGLE"): random_head(windowed["mistral"],
                                              str(root / "mistral_eagle"))[0]}


# (arch, algorithm, topk, --max-total-tokens, --swa-full-tokens-ratio): small pools release
# out-of-window SWA pages (and retract); the large ones keep finished prompts for radix hits.
DRAFTS = [("qwen2", "STANDALONE", 1, 640, 0.25), ("qwen2", "STANDALONE", 3, 2048, 0.8),
          ("qwen2", "EAGLE", 1, 640, 0.25), ("qwen2", "EAGLE3", 3, 2048, 0.8),
          ("mistral", "STANDALONE", 1, 320, 0.5), ("mistral", "EAGLE", 3, 2048, 0.8)]


@pytest.mark.parametrize("arch,algorithm,topk,tokens,ratio", DRAFTS,
                         ids=[f"{a}-{g}-topk{k}" for a, g, k, _, _ in DRAFTS])
def test_draft_model_speculation(arch, algorithm, topk, tokens, ratio, windowed, prompts,
                                 references, heads):
    """A draft model beside the SWA pool, chains and topk-3 trees: a STANDALONE self-draft
    and EAGLE / EAGLE3 heads (their K/V and features in a pool over the target's full
    slots; an all-SWA Mistral's full slots then exist for the draft alone, sized from the
    budget, kv_sizing_swa.py). Verify entries run the windows over SWA slots, rejected
    drafts' pages (both pools) are freed, every pool drains whole: transformers' tokens,
    prefix hits, drafts verified (a self-draft's accepted)."""
    from kvstrata.engine.sides.registry import spec_side

    path, refs = windowed[arch], references[arch]
    draft = path if algorithm == "STANDALONE" else heads[(arch, algorithm)]
    label = f"{arch} {algorithm} topk {topk}"
    with llm(path, max_total_tokens=tokens, swa_full_tokens_ratio=ratio, page_size=16,
             speculative_algorithm=algorithm, speculative_draft_model_path=draft,
             speculative_num_steps=3, speculative_eagle_topk=topk,
             speculative_num_draft_tokens=8 if topk > 1 else 4,
             speculative_disable_by_batch_size=1 << 20) as engine:
        plan = engine.server_info()["kv_plan"]
        assert plan["pool_kind"] == "swa" and plan["draft_components"], plan
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        check(outs, refs, label)
        side = spec_side(engine.engine.scheduler)
        assert side.verify_steps > 0 and side.drafted_tokens > 0, side.load()
        if algorithm == "STANDALONE":
            assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0
        # (the small pool evicts finished prompts' SWA pages: hits only in the big one)
        run(engine, prompts, refs, label, hits=ratio > 0.5)
