"""--enable-deterministic-inference at bf16: every request's tokens and logprobs equal, bit for
bit, its run alone on a cold engine -- whatever shares its batch (requests arriving at other
steps, prefill and decode mixed), its prefill chunks, the page size, the prefix cache (device
hits, HiCache load-backs), retraction under a small pool and priority preemption
(config/rules/deterministic.py), under --tp-size 2, and with STANDALONE / EAGLE speculation
(runs of one speculative configuration; greedy also equals plain decoding), and for Gemma 2's
soft-capped attention. The property test draws the tiny llama and qwen3 and DeepSeek's MLA
(V3) and DSA (V3.2) models (test_deterministic_mla.py: their float32 and V2 runs).

Without the flag the same workloads differ: a warm request's logprobs moved (the first test
shows it, so the property below is not vacuous on this CPU). Greedy and seeded sampling both:
a seeded request's draws are a function of (seed, position), not of its batch.
Randomised with hypothesis (KVSTRATA_FUZZ_EXAMPLES=N for a longer soak); each run has a step
bound and fails with the scheduler's load when it is passed.
"""
from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvstrata import LLM
from kvstrata.protocol.engine_request import EngineRequest
from kvstrata.protocol.sampling_params import SamplingParams

VOCAB = 300  # tests/conftest.py TINY_VOCAB
FUZZ_EXAMPLES = max(int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "400")) // 20, 8)
STEP_BOUND = 3000


def make_llm(path: str, deterministic: bool = True, dtype: str = "bfloat16", **kw) -> LLM:
    # explicit both ways: on an AVX2 CPU bf16 turns it on by default (deterministic.cpu_default)
    return LLM(model_path=path, skip_tokenizer_init=True, dtype=dtype,
               enable_deterministic_inference=deterministic,
               disable_deterministic_inference=not deterministic, **kw)


def params(max_new: int, seed: int | None) -> SamplingParams:
    sampled = {} if seed is None else {"temperature": 0.9, "top_p": 0.95, "seed": seed}
    return SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0,
                                     "ignore_eos": True, "logprobs": 0, **sampled})


def drive(llm: LLM, requests: list[tuple], priorities: list[int] | None = None) -> list[tuple]:
    """Each request (arrival step, prompt, params) joins at its step (with its priority, if
    given); returns each one's (tokens, logprobs, finish type) once every request ended. Fails
    past STEP_BOUND steps with the scheduler's load (a hang fails fast)."""
    engine = llm.engine
    got = {i: ([], [], None) for i in range(len(requests))}
    step = 0
    while step == 0 or any(v[2] is None for v in got.values()):
        for i, (arrival, prompt, sp) in enumerate(requests):
            if arrival == step:
                engine.add_request(EngineRequest(
                    f"r{i}", list(prompt), sp,
                    priority=None if priorities is None else priorities[i]))
        for out in engine.step():
            i = int(out.rid[1:])
            got[i][0].extend(out.new_token_ids)
            got[i][1].extend(out.new_logprobs or [])
            if out.finished:
                got[i] = (got[i][0], got[i][1], out.finish_reason.type)
        step += 1
        assert step < STEP_BOUND, f"no end after {step} steps: {engine.get_load()}"
    engine.check_integrity()
    return [got[i] for i in range(len(requests))]


_alone: dict = {}


def alone(path: str, prompt: list[int], sp: SamplingParams) -> tuple:
    """The reference: the request by itself on a cold engine (cache flushed), a large pool,
    no chunking."""
    key = (path, tuple(prompt), sp.max_new_tokens, sp.seed)
    if key not in _alone:
        if path not in _alone:
            _alone[path] = make_llm(path, max_total_tokens=4096, page_size=1)
        _alone[path].flush_cache()
        _alone[key] = drive(_alone[path], [(0, prompt, sp)])[0]
    return _alone[key]


def prompts_with_prefix(seed: int, shared: int, tails: list[int], vocab: int = VOCAB
                        ) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(t)] for t in tails]


def cold_runs(llm: LLM, work: list[tuple]) -> list[tuple]:
    """Each request of `work` alone on `llm` with its cache flushed first."""
    out = []
    for _, prompt, sp in work:
        llm.flush_cache()
        out.append(drive(llm, [(0, prompt, sp)])[0])
    return out


def test_without_the_flag_a_warm_request_moves(tiny_checkpoints):
    """The control: at bf16 without the flag a prompt whose prefix is cached answers with other
    logprobs than cold (this CPU's kernels sum a cached prefix in another order); with it,
    the same bits."""
    path = tiny_checkpoints["llama"]
    prompts = prompts_with_prefix(0, 40, [9, 17, 25])
    sp = params(8, None)
    for deterministic in (False, True):
        llm = make_llm(path, deterministic, max_total_tokens=4096)
        cold = []
        for p in prompts:
            llm.flush_cache()
            cold.append(drive(llm, [(0, p, sp)])[0])
        warm = drive(llm, [(i, p, sp) for i, p in enumerate(prompts)])
        llm.shutdown()
        if deterministic:
            assert warm == cold
        else:
            assert any(w[1] != c[1] for w, c in zip(warm, cold)), "the control did not move"


def test_retraction_and_restore_keep_the_bits(tiny_checkpoints):
    """Six requests in a pool too small for their decodes, chunked: some are retracted and
    recomputed; greedy and seeded, each equals its cold run alone."""
    path = tiny_checkpoints["qwen3"]
    llm = make_llm(path, page_size=4, chunked_prefill_size=16, max_total_tokens=160,
                   schedule_conservativeness=0.05)
    prompts = prompts_with_prefix(5, 0, [5, 17, 33, 64, 9, 120])
    work = [(0, p, params(24, None if i % 2 else 1000 + i)) for i, p in enumerate(prompts)]
    outs = drive(llm, work)
    assert llm.engine.scheduler.num_retractions > 0, "the pool was meant to force retraction"
    llm.shutdown()
    for i, ((_, prompt, sp), out) in enumerate(zip(work, outs)):
        assert out == alone(path, prompt, sp), f"request {i}"


def test_w8a8_int8_keeps_the_bits(tiny_checkpoints):
    """--quantization w8a8_int8 (its int8 GEMM is batch-invariant as it stands): requests
    sharing a prefix, chunked, arriving at other steps, greedy and seeded, each equal their
    cold run alone on the same quantized engine."""
    llm = make_llm(tiny_checkpoints["llama"], quantization="w8a8_int8", chunked_prefill_size=7,
                   max_total_tokens=4096)
    assert llm.server_info()["quantization_info"]["batch_invariant"]
    prompts = prompts_with_prefix(3, 20, [4, 11, 19])
    work = [(i, p, params(8, None if i % 2 else 77 + i)) for i, p in enumerate(prompts)]
    cold = cold_runs(llm, work)
    warm = drive(llm, work)
    llm.shutdown()
    assert warm == cold


def test_gemma2_soft_capped_attention_keeps_the_bits(tmp_path):
    """Gemma 2's soft-capped attention logits (and its window of 8) in the paged decode kernel
    (csrc/paged_decode_isa.h): prompts sharing a prefix of 13 tokens (past the window),
    chunked by 8 on pages of 4, arriving at other steps (later ones hit the radix cache, mixed with others'
    decodes), then all again (whole-prompt radix hits), greedy and seeded: each equals its
    cold run alone, bit for bit."""
    from helpers.gemma_ckpt import build_gemma_checkpoint
    path = build_gemma_checkpoint("gemma2", str(tmp_path / "gemma2"))
    llm = make_llm(path, chunked_prefill_size=8, page_size=4, max_total_tokens=4096)
    prompts = prompts_with_prefix(8, 13, [3, 11, 1, 20])
    work = [(i, p, params(10, None if i % 2 else 50 + i)) for i, p in enumerate(prompts)]
    cold = cold_runs(llm, work)
    mixed = drive(llm, work)
    again = drive(llm, [(0, p, sp) for _, p, sp in work])
    llm.shutdown()
    assert mixed == cold
    assert again == cold


_llms: dict = {}


def engine_for(arch: str, path: str, page_size: int, pool_tokens: int, chunk: int,
               hicache: bool, priority: bool) -> LLM:
    key = (arch, page_size, pool_tokens, chunk, hicache, priority)
    if key not in _llms:
        kw = dict(page_size=page_size, max_total_tokens=pool_tokens,
                  chunked_prefill_size=chunk or -1, schedule_conservativeness=0.05)
        if hicache:
            kw.update(enable_hierarchical_cache=True, hicache_size=0, hicache_ratio=2.0)
        if priority:  # SGLang's preemption: a higher priority retracts a running request
            # (two running slots: a newcomer of higher priority finds them full)
            kw.update(enable_priority_scheduling=True, priority_scheduling_preemption_threshold=0,
                      max_running_requests=2)
        for llm in _llms.values():  # one engine alive at a time
            llm.shutdown()
        _llms.clear()
        _llms[key] = make_llm(path, **kw)
    return _llms[key]


@pytest.fixture(scope="module")
def property_checkpoints(tiny_checkpoints, tiny_dsa_checkpoint, tmp_path_factory) -> dict:
    """The dense tiny models, DeepSeek-V3's MLA (helpers/moe_ckpt.py) and V3.2's DSA."""
    from helpers.moe_ckpt import build_moe_checkpoint

    v3 = build_moe_checkpoint("deepseek_v3", str(tmp_path_factory.mktemp("det_v3") / "v3"))
    return {**tiny_checkpoints, "deepseek_v3": v3, "deepseek_v32": tiny_dsa_checkpoint}


@settings(max_examples=FUZZ_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(["llama", "qwen3", "deepseek_v3", "deepseek_v32"]), page_size=st.sampled_from([1, 16]),
       pool=st.sampled_from(["small", "small", "large"]), chunk=st.sampled_from([0, 1, 2]),
       hicache=st.booleans(), priority=st.booleans(), shared=st.integers(0, 24),
       requests=st.lists(st.tuples(st.integers(1, 16), st.integers(1, 24), st.integers(0, 6),
                                   st.one_of(st.none(), st.integers(0, 2**31 - 1)),
                                   st.integers(0, 3)),
                         min_size=1, max_size=5),
       seed=st.integers(0, 1000))
def test_every_request_equals_its_cold_run_alone(property_checkpoints, arch, page_size, pool,
                                                 chunk, hicache, priority, shared, requests,
                                                 seed):
    """requests: (prompt tail, max new tokens, arrival step, sampling seed or greedy,
    priority: used with priority scheduling, whose preemption retracts running requests)."""
    path = property_checkpoints[arch]
    # small: a request fits alone (at most 40 + 24 - 1 positions: 4 pages of 16), a few do not
    pool_tokens = 64 if pool == "small" else 2048
    chunk_tokens = chunk * (16 if page_size == 16 else 7)
    llm = engine_for(arch, path, page_size, pool_tokens, chunk_tokens, hicache, priority)
    prompts = prompts_with_prefix(seed, shared, [r[0] for r in requests])
    work = [(arrival, p, params(max_new, sp_seed))
            for p, (_, max_new, arrival, sp_seed, _) in zip(prompts, requests)]
    before = llm.get_load()
    outs = drive(llm, work, [r[4] for r in requests] if priority else None)
    after = llm.get_load()
    event(f"retracted: {after['num_retractions'] > before['num_retractions']}")
    event(f"preempted: {after.get('num_preempted_reqs', 0) > before.get('num_preempted_reqs', 0)}")
    for i, ((_, prompt, sp), out) in enumerate(zip(work, outs)):
        assert out[2] == "length", f"request {i} ended {out[2]}"
        ref = alone(path, prompt, sp)
        assert out[0] == ref[0], f"request {i}: tokens differ from its cold run alone"
        assert out[1] == ref[1], f"request {i}: logprobs differ from its cold run alone"


@pytest.fixture(scope="module", autouse=True)
def _shutdown_engines():
    yield
    for cache in (_llms, _alone):
        for llm in cache.values():
            if isinstance(llm, LLM):
                llm.shutdown()
        cache.clear()


def test_two_tensor_parallel_ranks_keep_the_bits(tiny_checkpoints):
    """Under --tp-size 2 (each rank's share of the GEMMs, then the all-reduce in rank order)
    a batch of requests arriving at different steps equals each run alone on the same TP
    engine. Another TP size may answer differently (docs/configuration.md)."""
    path = tiny_checkpoints["llama"]
    llm = make_llm(path, tp_size=2, max_total_tokens=2048)
    try:
        prompts = prompts_with_prefix(3, 30, [5, 12, 20, 9])
        work = [(i, p, params(10, None if i % 2 else 7 + i)) for i, p in enumerate(prompts)]
        together = drive(llm, work)
        for w, got in zip(work, together):
            llm.flush_cache()
            assert drive(llm, [(0, w[1], w[2])])[0] == got
    finally:
        llm.shutdown()


@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE"])
def test_speculative_requests_keep_the_bits(tiny_checkpoints, tmp_path, algorithm):
    """Speculative decoding with --enable-deterministic-inference at bf16: a seeded (and a
    greedy) request answers the same tokens and logprobs alone on a cold engine as beside
    others arriving at other steps, sharing its prefix (warm: a radix hit), chunked -- runs of
    one configuration (issue 60: "seeded sampling: identical across runs of the same
    configuration"); greedy also equals the non-speculative answer."""
    from tests.helpers.eagle_heads import random_head

    path = tiny_checkpoints["llama"]
    draft = path if algorithm == "STANDALONE" else random_head(path, str(tmp_path / "h"))[0]
    spec = dict(speculative_algorithm=algorithm, speculative_draft_model_path=draft,
                speculative_num_steps=3, speculative_disable_by_batch_size=1 << 20)
    prompts = prompts_with_prefix(11, 24, [9, 30, 4, 17])
    work = [(i % 3, p, params(20, None if i % 2 else 500 + i)) for i, p in enumerate(prompts)]
    cold = make_llm(path, max_total_tokens=4096, page_size=1, **spec)
    refs = []
    for _, p, sp in work:
        cold.flush_cache()
        refs.append(drive(cold, [(0, p, sp)])[0])
    cold.shutdown()
    busy = make_llm(path, max_total_tokens=1024, page_size=4, chunked_prefill_size=16, **spec)
    drive(busy, [(0, prompts[0], params(4, None))])  # the shared prefix is now cached
    outs = drive(busy, work)
    assert busy.engine.scheduler.kv.matched_tokens >= 4 * 24, "the shared prefix never hit"
    busy.shutdown()
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out == ref, f"request {i}"
    for i, (_, p, sp) in enumerate(work):
        if sp.seed is None:
            assert refs[i][0] == alone(path, p, sp)[0], f"greedy request {i} vs plain"
