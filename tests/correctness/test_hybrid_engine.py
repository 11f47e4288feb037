"""Hybrid recurrent models end to end: kvstrata.LLM with the real scheduler, state-slot pool and
snapshot prefix cache (cache/state_slots.py, state_radix.py) over the runner's state pool, sized
from the loaded model's ModelKVFacts.state_components (config/kv_sizing_state.py). Greedy tokens
must equal transformers' (float32, tests/helpers/hybrid_ckpt.py's tiny Qwen3.5, Qwen3-Next,
Nemotron-H, Mamba2 and Granite-4.0-H); every KV and state-slot invariant is checked after every
step (KVSTRATA_CHECK_INTEGRITY, tests/conftest.py) and the pools are whole after each drain.

- page sizes 1 (no_buffer) and 16 (extra_buffer, a snapshot at every page end), prompts whole or
  in chunks that do and do not divide them;
- prefix hits: a chat's second turn resumes at the snapshot its first turn left (at its end);
  a prompt sharing part of an earlier one resumes at a chunk-end snapshot between others; a
  shared system prompt is snapshotted at the branch point by the second request and hit by the
  third (each with its hit size asserted);
- a starved KV pool that retracts (and recomputes from a reset state); a starved state pool
  (admission waits, snapshots evicted);
- aborts mid-prefill and mid-decode.
"""
from __future__ import annotations

import pytest
import torch

from helpers.hybrid_ckpt import HYBRIDS, VOCAB, HFGreedy, hybrid_checkpoints
from kvstrata import LLM
from kvstrata.engine.request import EngineRequest
from kvstrata.protocol import SamplingParams

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
LENS = (1, 29, 64, 70)  # one token, under a page, 4 pages exactly, across the GDN 64-chunk
SYSTEM = 24             # a shared system prompt's length

_engines: dict = {}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return hybrid_checkpoints(str(tmp_path_factory.mktemp("hybrid_engine")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENS]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for e in _engines.values():
        e.shutdown()
    _engines.clear()


class Reference(HFGreedy):
    def __call__(self, prompt: list[int], new: int = NEW) -> list[int]:
        return super().__call__(prompt, new)


_refs: dict = {}


@pytest.fixture(scope="module")
def ref(paths):
    def get(arch: str) -> Reference:
        if arch not in _refs:
            _refs[arch] = Reference(paths[arch])
        return _refs[arch]
    yield get
    _refs.clear()


def engine(path: str, **kw) -> LLM:
    """One engine per configuration in this module (its tree starts cold for each test:
    flush_cache)."""
    kw = {"max_total_tokens": 2048, "max_mamba_cache_size": 48, **kw}
    key = (path, tuple(sorted(kw.items())))
    if key not in _engines:
        _engines[key] = LLM(path, skip_tokenizer_init=True, dtype="float32", **kw)
    llm = _engines[key]
    assert llm.flush_cache()
    return llm


def generate(llm: LLM, prompts: list[list[int]], new: int = NEW
             ) -> tuple[list[list[int]], list[int]]:
    outs = llm.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": new})
    whole(llm)
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


def whole(llm: LLM) -> None:
    """Drained: no request left, every pool and the state slots whole (free + held + cached)."""
    sched = llm.engine.scheduler
    assert not sched.live_requests() and not sched.waiting
    llm.check_integrity()
    states = sched.kv.states
    assert states.allocator.available_pages() + states.tree.cached_states() == states.num_slots


def expect(got, prompts, reference, label, new: int = NEW):
    for i, (p, g) in enumerate(zip(prompts, got)):
        assert g == reference(p, new), f"{label}: prompt {i} ({len(p)} tokens)"


# ------------------------------------------------------------------ tokens and sizing
@pytest.mark.parametrize("arch", HYBRIDS)
def test_plan_sized_from_the_model(arch, paths):
    """The state pool the engine sized is the model's: its components (ssm in
    --mamba-ssm-dtype), the slots asked for, the slots // per-request bound on concurrency;
    Mamba2 keeps no K/V at all."""
    llm = engine(paths[arch], page_size=16)
    info = llm.server_info()
    plan, facts = info["kv_plan"], llm.engine.runner.kv_facts()
    assert plan["num_state_slots"] == 48
    assert [(c["name"], c["slot_shape"]) for c in plan["state_components"]] == [
        (c.name, list(c.slot_shape)) for c in facts.state_components]
    assert info["max_running_requests"] == 48 // 4  # extra_buffer: 4 slots a request
    assert plan["pool_kind"] == ("none" if arch == "mamba2" else "mha")
    pool = llm.engine.runner.state_pool
    assert pool.num_slots == 49 and pool.tensors["ssm"].dtype == torch.float32


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2"])
def test_mamba_ssm_dtype_sets_the_pool(arch, paths, prompts):
    """--mamba-ssm-dtype bfloat16: the ssm component (and the pool tensor) in bf16, the conv
    window in the model's dtype; a slot is smaller, so the same byte budget gives more."""
    llm = LLM(paths[arch], skip_tokenizer_init=True, dtype="float32", page_size=1,
              max_mamba_cache_size=12, mamba_ssm_dtype="bfloat16",
              **({} if arch == "mamba2" else {"max_total_tokens": 512}))
    try:
        plan = llm.server_info()["kv_plan"]
        assert {c["name"]: c["dtype"] for c in plan["state_components"]} == {
            "conv": "float32", "ssm": "bfloat16"}
        pool = llm.engine.runner.state_pool
        assert (pool.tensors["conv"].dtype, pool.tensors["ssm"].dtype) == (
            torch.float32, torch.bfloat16)
        got, _ = generate(llm, prompts)
        assert all(len(g) == NEW for g in got)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("page_size,chunk", [(1, None), (16, None), (1, 7), (16, 32)])
def test_greedy_equals_transformers(arch, page_size, chunk, paths, prompts, ref):
    """chunk 7 divides the 70-token prompt, not the 29 / 64 ones; 32 divides 64, not 70."""
    llm = engine(paths[arch], page_size=page_size, chunked_prefill_size=chunk or -1)
    got, _ = generate(llm, prompts)
    expect(got, prompts, ref(arch), f"{arch} P={page_size} chunk={chunk}")


# ------------------------------------------------------------------ prefix hits
@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("page_size,chunk", [(1, None), (16, 16), (16, None)])
def test_second_chat_turn_resumes_at_the_first_turns_snapshot(arch, page_size, chunk, paths,
                                                              prompts, ref):
    """Turn 2 = turn 1's prompt + its answer + a new message. At page size 1 the first turn
    donates its state at its end (prompt + answer[:-1]); at 16 its last page-end snapshot
    (a chunk end, a decode track point, or -- the 70-token prompt whose 8-token answer
    crosses no page end -- the one its prefill forward took at 64 inside the prompt)."""
    llm = engine(paths[arch], page_size=page_size, chunked_prefill_size=chunk or -1)
    first, _ = generate(llm, prompts)
    turn2 = [p + a + [5, 6, 7] for p, a in zip(prompts, first)]
    got, hits = generate(llm, turn2)
    expect(got, turn2, ref(arch), f"{arch} P={page_size} turn 2")
    for p, a, hit in zip(prompts, first, hits):
        done = len(p) + len(a) - 1  # the first turn's computed tokens
        assert hit == done // page_size * page_size, (hits, [len(p) for p in prompts])


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h", "mamba2"])
def test_hit_between_snapshots(arch, paths, prompts, ref):
    """Chunks of 16 at page size 16 leave snapshots at 16, 32, 48, 64 of the 70-token
    prompt: a prompt sharing its first 40 tokens resumes at 32 (the K/V up to 32 and the
    state there), one sharing 64 at 64."""
    llm = engine(paths[arch], page_size=16, chunked_prefill_size=16)
    long = prompts[-1]
    generate(llm, [long])
    branches = [long[:40] + [7, 8, 9], long[:64] + [4, 4, 5, 6, 9]]
    got, hits = generate(llm, branches)
    assert hits == [32, 64]
    expect(got, branches, ref(arch), f"{arch} branches")


@pytest.mark.parametrize("arch", ["qwen3_5", "granite"])
@pytest.mark.parametrize("page_size,chunk", [(1, None), (16, 16)])
def test_shared_system_prompt(arch, page_size, chunk, paths, prompts, ref):
    """Three requests after one another sharing a system prompt. Page size 1: the second
    finds the first's K/V but no state there (a tombstone: the first request's snapshot is at
    its own end) and ends a prefill chunk at the branch point to snapshot it; the third
    resumes there. Page size 16 with chunks of 16: the first request's chunk ends leave
    snapshots at 16 and 32, the system prompt's end."""
    llm = engine(paths[arch], page_size=page_size, chunked_prefill_size=chunk or -1)
    system = prompts[-1][:SYSTEM if page_size == 1 else 32]
    asks = [system + q for q in ([11, 12, 13], [21, 22], [31, 32, 33, 34])]
    hits = []
    for ask in asks:
        got, hit = generate(llm, [ask])
        expect(got, [ask], ref(arch), f"{arch} P={page_size} system prompt")
        hits += hit
    assert hits == ([0, 0, SYSTEM] if page_size == 1 else [0, 32, 32])


# ------------------------------------------------------------------ pressure and aborts
# tp 2 (soak, ~15 s; the one tensor-parallel engine of this module): every rank's share of
# the recomputed state (runner/parallel/tp_hybrid.py).
@pytest.mark.parametrize("arch,page_size,chunk,tp", [
    ("qwen3_next", 1, 7, 1), ("nemotron_h", 16, 32, 1), ("granite", 16, 32, 1),
    pytest.param("nemotron_h", 16, 32, 2, marks=pytest.mark.soak)])
def test_starved_kv_pool_retracts_and_recomputes(arch, page_size, chunk, tp, paths, prompts,
                                                 ref):
    """A K/V pool of 160 tokens for 8 requests of up to 94: admitted on an optimistic
    decode estimate, their decodes run out and retract; a retracted request recomputes from
    a reset state (its working slot was freed)."""
    llm = engine(paths[arch], page_size=page_size, chunked_prefill_size=chunk,
                 max_total_tokens=160, schedule_conservativeness=0.05,
                 **({"tp_size": tp} if tp > 1 else {}))
    before = llm.engine.scheduler.num_retractions
    batch = prompts + [p[::-1] for p in prompts]
    got, _ = generate(llm, batch, new=24)
    assert llm.engine.scheduler.num_retractions > before
    expect(got, batch, ref(arch), f"{arch} P={page_size} retracted", new=24)


def test_starved_state_pool(paths, prompts, ref):
    """Mamba2 (no K/V: only state slots bound it) with 3 slots at page size 1: one request
    runs at a time, each finish's snapshot is evicted for the next working slot."""
    llm = engine(paths["mamba2"], page_size=1, max_mamba_cache_size=3)
    assert llm.server_info()["max_running_requests"] == 1
    tree = llm.engine.scheduler.kv.tree
    evicted = tree.total_evicted_states
    got, _ = generate(llm, prompts)
    expect(got, prompts, ref("mamba2"), "mamba2 3 slots")
    assert tree.total_evicted_states > evicted


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2"])
def test_aborts_mid_prefill_and_mid_decode(arch, paths, prompts, ref):
    """Chunks of 16: one request aborted between its chunks, two while decoding; the
    others answer exactly and every slot comes back."""
    llm = engine(paths[arch], page_size=16, chunked_prefill_size=16)
    core = llm.engine
    params = SamplingParams.from_dict(GREEDY)
    batch = prompts + [prompts[2][::-1]]
    out = {str(i): [] for i in range(len(batch))}
    for i, p in enumerate(batch):
        core.add_request(EngineRequest(str(i), list(p), params))
    finished, steps = {}, 0
    while core.has_unfinished_requests():
        if steps == 1:
            core.abort_request("3")            # 70 tokens: one chunk of 16 done
        if steps == 6:
            core.abort_request("1")
            core.abort_request("4")
        for o in core.step():
            out[o.rid] += o.new_token_ids
            if o.finished:
                finished[o.rid] = o.finish_reason.type
        steps += 1
    assert finished == {"0": "length", "1": "abort", "2": "length", "3": "abort",
                        "4": "abort"}
    assert 0 < len(out["1"]) < NEW and not out["3"]
    for i in (0, 2):
        assert out[str(i)] == ref(arch)(batch[i])
    whole(llm)
