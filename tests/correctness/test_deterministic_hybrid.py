"""--enable-deterministic-inference on the recurrent hybrids (runner/models/hybrid_fixed.py,
runner/recurrent/fixed_scan.py): every request's tokens and logprobs equal, bit for bit, its
run alone on a cold engine -- whatever shares its batch, however its prompt is chunked, and
wherever its KV and state came from (a prefix hit at a state snapshot, HiCache L2, a restart
on a warm L3 file store, a PD prefill server, a retraction's recompute). Tiny Qwen3.5 (Gated
DeltaNet + gated attention), Nemotron-H (Mamba2 + attention + MLP), Granite-4.0-H (Mamba2 +
roped attention, top-k MoE + shared MLP, muP multipliers), Falcon-H1 (attention beside a
Mamba2 mixer in every layer, multipliers) and Nemotron-H with MoE layers (relu^2 experts,
grouped sigmoid router) at bf16, Mamba2, Qwen3-Next and Qwen3.5-MoE (their MoE pinned) too
where cheap (tests/helpers/hybrid_ckpt.py); at float32 greedy equals transformers.

Controls: without the flag the warm / chunked / batched workload moves (engine level); the
chunked SSD scan continued from a mid-way state differs from its straight run, the pinned
scan does not (kernel level); the position-free activations give an element the same bits
wherever it sits (torch's values within rounding).
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.hybrid_ckpt import (VOCAB, HFGreedy, build_falcon_h1_checkpoint,
                                  build_nemotron_h_moe_checkpoint, build_qwen3_5_moe_checkpoint,
                                  hybrid_checkpoints)
from kvstrata import LLM
from kvstrata.runner.recurrent import pointwise
from kvstrata.runner.recurrent.backend import RecurrentMeta
from kvstrata.runner.recurrent.fixed_scan import FixedRecurrentBackend
from kvstrata.runner.recurrent.ssd import ssd_chunk_scan
from tests.correctness.test_deterministic_inference import drive, params
from tests.correctness.test_deterministic_inference import \
    prompts_with_prefix as shared_prefix_prompts

FUZZ_EXAMPLES = max(int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "400")) // 50, 4)
ARCHS = ("qwen3_5", "qwen3_next", "nemotron_h", "mamba2", "granite")
# the families beside hybrid_checkpoints' (their own builders)
ALL_ARCHS = (*ARCHS, "falcon_h1", "nemotron_h_moe", "qwen3_5_moe")
MOE_LAYERS = {"qwen3_next": 2, "granite": 4, "nemotron_h_moe": 2,  # the tiny configs' MoE blocks
              "qwen3_5_moe": 4}

_llms: dict = {}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = str(tmp_path_factory.mktemp("det_hybrid"))
    return {**hybrid_checkpoints(root, ARCHS),
            "falcon_h1": build_falcon_h1_checkpoint(os.path.join(root, "falcon_h1")),
            "nemotron_h_moe": build_nemotron_h_moe_checkpoint(
                os.path.join(root, "nemotron_h_moe")),
            "qwen3_5_moe": build_qwen3_5_moe_checkpoint(os.path.join(root, "qwen3_5_moe"))}


@pytest.fixture(scope="module", autouse=True)
def _shutdown_engines():
    yield
    for llm in [*_llms.values(), *_alone.values()]:
        if isinstance(llm, LLM):
            llm.shutdown()
    _llms.clear()
    _alone.clear()


def make_llm(path: str, deterministic: bool = True, dtype: str = "bfloat16", **kw) -> LLM:
    kw = {"max_total_tokens": 2048, "max_mamba_cache_size": 48, **kw}
    return LLM(model_path=path, skip_tokenizer_init=True, dtype=dtype,
               enable_deterministic_inference=deterministic,
               disable_deterministic_inference=not deterministic, **kw)


def engine(path: str, **kw) -> LLM:
    """One engine alive at a time, kept while the configuration repeats."""
    key = (path, tuple(sorted(kw.items())))
    if key not in _llms:
        for llm in _llms.values():
            llm.shutdown()
        _llms.clear()
        _llms[key] = make_llm(path, **kw)
    return _llms[key]


_alone: dict = {}


def alone(path: str, prompt: list[int], sp) -> tuple:
    """The reference: the request by itself on a cold engine (cache flushed), unchunked (one
    reference engine per model, beside the engine under test)."""
    key = (path, tuple(prompt), sp.max_new_tokens, sp.seed)
    if key not in _alone:
        if path not in _alone:
            _alone[path] = make_llm(path, page_size=1)
        _alone[path].flush_cache()
        _alone[key] = drive(_alone[path], [(0, prompt, sp)])[0]
    return _alone[key]


def prompts_with_prefix(seed: int, shared: int, tails: list[int]) -> list[list[int]]:
    return shared_prefix_prompts(seed, shared, tails, VOCAB)  # the hybrids' vocabulary


# ------------------------------------------------------------------ kernels
def test_position_free_activations_ignore_an_elements_place():
    """Each element's bits equal its value computed alone, in tensors of any length (past the
    threading threshold too), in float32 and bf16; the values are torch's up to rounding."""
    g = torch.Generator().manual_seed(3)
    for n in (1, 7, 33, 70_001):
        x = torch.randn(n, generator=g) * 8
        for op, ref in ((pointwise.sigmoid, torch.sigmoid), (pointwise.silu, F.silu),
                        (pointwise.softplus, F.softplus)):
            whole = op(x)
            picks = range(0, n, max(1, n // 50))
            assert all(torch.equal(whole[i:i + 1], op(x[i:i + 1])) for i in picks), op
            if n > 3:  # shifted by 3 elements: other vector lanes and thread bounds
                assert torch.equal(op(x[3:]), whole[3:])
            torch.testing.assert_close(whole, ref(x), rtol=2e-6, atol=1e-6)
            half = op(x.bfloat16())
            assert half.dtype == torch.bfloat16 and torch.equal(half[1:], op(x.bfloat16()[1:]))


def _ssd_inputs(length: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    heads, p, groups, n = 4, 8, 2, 16
    return (torch.randn(length, heads, p, generator=g),
            torch.rand(length, heads, generator=g) * 0.5,
            -torch.rand(heads, generator=g) - 0.2,
            torch.randn(length, groups, n, generator=g),
            torch.randn(length, groups, n, generator=g),
            torch.randn(heads, generator=g))


def _run_pinned(backend: FixedRecurrentBackend, inputs, start: int, n: int, decode: bool):
    fb = SimpleNamespace(num_reqs=1, q_lens=[n], start_pos=[start],
                         input_ids=torch.zeros(n, dtype=torch.long), recurrent=None)
    fb.recurrent = RecurrentMeta.build(fb, [1], [False])
    assert bool(fb.recurrent.decode) == decode
    x, dt, A, B, C, D = inputs
    return backend.ssd(0, fb, x[start:start + n], dt[start:start + n], A,
                       B[start:start + n], C[start:start + n], D)


def test_pinned_scan_is_chunk_invariant_where_the_chunked_scan_is_not():
    """40 tokens through the pinned Mamba2 scan in one prefill, in chunks of 13 + 27, and as
    7 prompt tokens then 33 decode steps: the same outputs and final state, bit for bit. The
    chunked SSD scan continued from its state at 13 differs from its straight run there."""
    inputs = _ssd_inputs(40)
    runs = []
    for plan in ([(0, 40)], [(0, 13), (13, 27)], [(0, 7)] + [(t, 1) for t in range(7, 40)]):
        pool = SimpleNamespace(ssm=torch.full((1, 2, 4, 8, 16), 7.0), conv=None)
        backend = FixedRecurrentBackend(pool)
        ys = [_run_pinned(backend, inputs, s, n, decode=n == 1 and s > 0) for s, n in plan]
        runs.append((torch.cat(ys), pool.ssm[0, 1].clone()))
    for y, state in runs[1:]:
        assert torch.equal(y, runs[0][0]) and torch.equal(state, runs[0][1])
    x, dt, A, B, C, D = (t[None] if t.dim() > 1 else t for t in inputs)
    y_full, s_full = ssd_chunk_scan(x, dt, A, B, C, D, None, chunk=8)
    _, mid = ssd_chunk_scan(x[:, :13], dt[:, :13], A, B[:, :13], C[:, :13], D, None, chunk=8)
    y_tail, s_split = ssd_chunk_scan(x[:, 13:], dt[:, 13:], A, B[:, 13:], C[:, 13:], D, mid,
                                     chunk=8)
    torch.testing.assert_close(s_split, s_full)
    assert not torch.equal(s_split, s_full) or not torch.equal(y_tail, y_full[:, 13:])
    torch.testing.assert_close(runs[0][1], s_full[0], rtol=1e-5, atol=1e-5)


def _random_model(arch: str):
    """Our model of a tiny config (float32, weights drawn here), not loaded from a file."""
    from helpers.hybrid_ckpt import (tiny_falcon_h1_config, tiny_hybrid_config,
                                     tiny_nemotron_h_moe_config)
    from kvstrata.runner.models.falcon_h1 import FalconH1ForCausalLM
    from kvstrata.runner.models.granite_hybrid import GraniteMoeHybridForCausalLM
    from kvstrata.runner.models.nemotron_h import NemotronHForCausalLM

    cls, config = {"granite": (GraniteMoeHybridForCausalLM, tiny_hybrid_config("granite")),
                   "falcon_h1": (FalconH1ForCausalLM, tiny_falcon_h1_config()),
                   # its latent projections and biases too (the checkpoint has none)
                   "nemotron_h_moe": (NemotronHForCausalLM, tiny_nemotron_h_moe_config(
                       moe_latent_size=32, mlp_bias=True))}[arch]
    model = cls(config, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(21)
    for t in model.parameters():
        t.data.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return model


# arch -> (layer, block) whose matmuls run on however many tokens reach them
FEED_FORWARD_BLOCKS = {"granite": (0, "moe"), "nemotron_h_moe": (1, "mixer"),
                       "falcon_h1": (0, "mlp")}


@pytest.mark.parametrize("arch", sorted(FEED_FORWARD_BLOCKS))
def test_pinned_feed_forward_gives_a_row_the_same_bits_in_any_batch(arch):
    """float32 (torch's F.linear is batch-variant there on every CPU measured: MKL's GEMV /
    GEMM bodies): Granite's top-k MoE, Nemotron-H's MoE block and Falcon-H1's MLP give a slice
    of rows other bits than the same rows inside the whole batch (the control); pinned
    (hybrid_fixed.pin_hybrid_model), every slice equals. Also the wiring that tiny engines
    cannot tell apart: the position-free SiLU, the exact rotation and the blocked cos / sin."""
    import copy

    from kvstrata.runner.models.deepseek_fixed import BlockedCosSin
    from kvstrata.runner.models.hybrid_fixed import exact_rope, pin_hybrid_model

    model = _random_model(arch)
    layer, part = FEED_FORWARD_BLOCKS[arch]
    plain = copy.deepcopy(getattr(model.layers[layer], part))
    info = pin_hybrid_model(model)
    pinned = getattr(model.layers[layer], part)
    x = torch.randn(80, model.dims.hidden_size, generator=torch.Generator().manual_seed(4))
    slices = [(lo, n) for n in (1, 2, 5, 16, 17, 33, 64) for lo in (0, 7)]
    with torch.inference_mode():
        differ = {}
        for name, block in (("plain", plain), ("pinned", pinned)):
            whole = block(x)
            differ[name] = sum(not torch.equal(block(x[lo:lo + n]), whole[lo:lo + n])
                               for lo, n in slices)
    assert differ["plain"] > 0, "the control did not move"
    assert differ["pinned"] == 0
    assert info["pinned_moe_layers"] == MOE_LAYERS.get(arch, 0)
    for block in model.layers:
        for sub in (getattr(block, name, None) for name in ("mixer", "attn", "mamba", "mlp")):
            if hasattr(sub, "act"):
                assert sub.act is pointwise.POSITION_FREE
            if hasattr(sub, "rope"):
                assert sub.rope is exact_rope
    if getattr(model, "rotary", None) is not None:  # Falcon-H1's, the tiny Granite's (rope)
        assert isinstance(model.rotary.plain_cos_sin, BlockedCosSin)


# ------------------------------------------------------------------ engines
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_greedy_equals_transformers_with_the_flag(arch, paths):
    """float32, chunks of 7: greedy tokens are transformers'."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 29, 70)]
    llm = make_llm(paths[arch], dtype="float32", page_size=1, chunked_prefill_size=7)
    try:
        info = llm.server_info()
        assert info["deterministic_recurrent_kernel"]
        assert info["quantization_info"]["recurrent_kernel"]
        assert info["quantization_info"]["pinned_moe_layers"] == MOE_LAYERS.get(arch, 0)
        outs = llm.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    finally:
        llm.shutdown()
    ref = HFGreedy(paths[arch])
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == ref(p, 8), f"{arch}: {len(p)} tokens"


# Falcon-H1: its parallel layers keep K/V and a state at one index (Granite's and
# Nemotron-H MoE's Mamba2 layers are Nemotron-H's; the property test samples them)
@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h", "mamba2", "falcon_h1"])
def test_warm_chunked_and_batched_requests_keep_the_bits(arch, paths):
    """Prompts sharing 40 tokens, chunked by 16 on pages of 16 (state snapshots at 16, 32),
    arriving at other steps beside each other's decodes, greedy and seeded: each equals its
    cold run alone; then all again (hits at their snapshots) -- the same bits."""
    path = paths[arch]
    prompts = prompts_with_prefix(7, 40, [3, 11, 25, 1])
    work = [(i, p, params(10, None if i % 2 else 40 + i)) for i, p in enumerate(prompts)]
    refs = [alone(path, p, sp) for _, p, sp in work]
    llm = engine(path, page_size=16, chunked_prefill_size=16)
    llm.flush_cache()
    mixed = drive(llm, work)
    matched = llm.engine.scheduler.kv.matched_tokens
    again = drive(llm, [(0, p, sp) for _, p, sp in work])
    assert llm.engine.scheduler.kv.matched_tokens > matched, "no prefix hit"
    assert mixed == refs
    assert again == refs


def test_an_unpinned_hybrid_class_is_refused_by_name_at_load():
    """Pinning refuses a hybrid class it was not built for by its name (a tensor-parallel
    rank's class, say; resolution refuses those combinations first)."""
    from helpers.hybrid_ckpt import tiny_hybrid_config
    from kvstrata.runner.models.hybrid_fixed import pin_hybrid_model
    from kvstrata.runner.models.qwen3_next import Qwen3_5ForCausalLM

    class SomeRankOfQwen3_5(Qwen3_5ForCausalLM):
        pass

    model = SomeRankOfQwen3_5(tiny_hybrid_config("qwen3_5"), torch.float32,
                              torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="deterministic-inference on "
                                                  "SomeRankOfQwen3_5 \\(built for"):
        pin_hybrid_model(model)


def test_without_the_flag_the_same_requests_move(paths):
    """The control at bf16: without the flag, the workload of
    test_warm_chunked_and_batched_requests_keep_the_bits (prompts sharing 40 tokens, chunks
    of 16 on pages of 16, batched, resuming at cached snapshots) answers with other logprobs
    than each prompt's cold unchunked run (the chunked scans sum from where a chunk starts,
    the kernels by row count): so that test is not vacuous here (the MoE blocks' control:
    test_pinned_feed_forward_gives_a_row_the_same_bits_in_any_batch)."""
    path = paths["qwen3_5"]
    prompts = prompts_with_prefix(9, 40, [5, 13, 21, 30])
    sp = params(8, None)
    cold = make_llm(path, deterministic=False, page_size=1)
    try:
        refs = []
        for p in prompts:
            cold.flush_cache()
            refs.append(drive(cold, [(0, p, sp)])[0])
    finally:
        cold.shutdown()
    busy = make_llm(path, deterministic=False, page_size=16, chunked_prefill_size=16)
    try:
        drive(busy, [(0, prompts[0], sp)])
        warm = drive(busy, [(i, p, sp) for i, p in enumerate(prompts)])
    finally:
        busy.shutdown()
    assert any(w[1] != r[1] for w, r in zip(warm, refs)), "the control did not move"


def test_a_restart_on_a_warm_file_store_keeps_the_bits(paths, tmp_path):
    """HiCache L3 under the flag at bf16: a first Qwen3.5 engine answers two prompts (chunks
    of 32 on pages of 16, write_through to the file store) and shuts down; a second one over
    the same directory answers their follow-up turns from the stored pages and state
    snapshots. Each follow-up (greedy, seeded) equals its cold run alone, bit for bit."""
    path = paths["qwen3_5"]
    kw = dict(page_size=16, max_total_tokens=512, max_mamba_cache_size=12,
              chunked_prefill_size=32, enable_hierarchical_cache=True, hicache_ratio=4.0,
              hicache_write_policy="write_through", hicache_storage_backend="file",
              hicache_storage_prefetch_policy="wait_complete",
              hicache_storage_backend_extra_config=json.dumps(
                  {"prefetch_threshold": 8, "file_path": str(tmp_path)}))
    prompts = prompts_with_prefix(13, 0, [45, 58])
    first = make_llm(path, **kw)
    try:
        outs = [drive(first, [(0, p, params(6, None))])[0] for p in prompts]
        assert first.engine.finish_storage_backups(timeout=30)
    finally:
        first.shutdown()
    work = [(0, p + o[0] + [5, 6, 7], params(6, None if i else 31))
            for i, (p, o) in enumerate(zip(prompts, outs))]
    second = make_llm(path, **kw)
    try:
        got = [drive(second, [w])[0] for w in work]
        load = second.engine.get_load()
    finally:
        second.shutdown()
    assert load["hicache_storage_state_hits"] == 2 and load["hicache_storage_hit_tokens"], load
    for i, (w, g) in enumerate(zip(work, got)):
        assert g == alone(path, w[1], w[2]), f"follow-up {i}"


def test_a_pd_pair_answers_like_the_co_located_engine(paths, monkeypatch):
    """PD under the flag at bf16 (Qwen3.5, tcp, in one process): the prefill server streams
    the pages in chunks of 32 and the final state slot; the decode server's tokens and
    logprobs (greedy and seeded) equal each prompt's cold co-located run alone."""
    from kvstrata.config.server_args import ServerArgs
    from kvstrata.entrypoints.engine_factory import build_engine
    from kvstrata.protocol.disagg import BootstrapAddr
    from kvstrata.protocol.engine_request import EngineRequest
    from tests.helpers.ports import free_port

    monkeypatch.setenv("KVSTRATA_DISAGG_BOOTSTRAP_TIMEOUT", "60")
    path = paths["qwen3_5"]

    def server(mode: str, port: int, **kw):
        return build_engine(ServerArgs(
            model_path=path, skip_tokenizer_init=True, dtype="bfloat16",
            enable_deterministic_inference=True, disaggregation_mode=mode,
            disaggregation_bootstrap_port=port, disaggregation_transfer_backend="tcp",
            page_size=16, max_running_requests=8, max_mamba_cache_size=24,
            max_total_tokens=2048, **kw))[0]

    port = free_port()
    prefill, decode = server("prefill", port, chunked_prefill_size=32), server("decode",
                                                                                free_port())
    work = [(p, params(8, None if i % 2 else 70 + i))
            for i, p in enumerate(prompts_with_prefix(17, 20, [9, 30, 51]))]
    got = {str(i): ([], []) for i in range(len(work))}
    try:
        for i, (p, sp) in enumerate(work):
            for eng in (prefill, decode):
                room = BootstrapAddr("127.0.0.1", port, 700 + i)
                eng.add_request(EngineRequest(str(i), list(p), sp, bootstrap=room))
        for _ in range(20_000):
            if not (prefill.has_unfinished_requests() or decode.has_unfinished_requests()):
                break
            prefill.step()
            for o in decode.step():
                got[o.rid][0].extend(o.new_token_ids)
                got[o.rid][1].extend(o.new_logprobs or [])
    finally:
        prefill.shutdown()
        decode.shutdown()
    for i, (p, sp) in enumerate(work):
        assert got[str(i)] == alone(path, p, sp)[:2], f"prompt {i}"


@settings(max_examples=FUZZ_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(["qwen3_5", "nemotron_h", "granite", "falcon_h1",
                              "nemotron_h_moe", "qwen3_5_moe"]), page_size=st.sampled_from([1, 16]),
       pool=st.sampled_from(["small", "large"]), chunk=st.sampled_from([0, 1, 2]),
       hicache=st.booleans(), shared=st.integers(0, 40),
       requests=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 5),
                                   st.one_of(st.none(), st.integers(0, 2**31 - 1))),
                         min_size=1, max_size=4),
       seed=st.integers(0, 1000))
def test_every_request_equals_its_cold_run_alone(paths, arch, page_size, pool, chunk, hicache,
                                                 shared, requests, seed):
    """requests: (prompt tail, max new tokens, arrival step, sampling seed or greedy). A
    small pool retracts (its requests recompute their state from zeros)."""
    path = paths[arch]
    kw = dict(page_size=page_size, max_total_tokens=96 if pool == "small" else 2048,
              chunked_prefill_size=chunk * (16 if page_size == 16 else 7) or -1,
              schedule_conservativeness=0.05)
    if hicache:
        kw.update(enable_hierarchical_cache=True, hicache_size=0, hicache_ratio=2.0)
    prompts = prompts_with_prefix(seed, shared, [r[0] for r in requests])
    work = [(arrival, p, params(max_new, sp_seed))
            for p, (_, max_new, arrival, sp_seed) in zip(prompts, requests)]
    refs = [alone(path, p, sp) for _, p, sp in work]
    outs = drive(engine(path, **kw), work)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out[0] == ref[0], f"request {i}: tokens differ from its cold run alone"
        assert out[1] == ref[1], f"request {i}: logprobs differ from its cold run alone"
