"""DeepSeek-V3 and V2-Lite (MLA without the DSA indexer: runner/models/deepseek.py,
attention/mla_dense.py) across PD with real runners, in one process: a prefill and a decode
EngineCore (the server's engine factory, --disaggregation-mode prefill / decode, the tcp
backend on 127.0.0.1) over tiny float32 checkpoints (helpers/moe_ckpt.py), stepped in turn.
Only the MLA latent pages cross (one component, no indexer keys); the decode's greedy tokens
equal transformers' and the co-located engine's, on pages of 1 and 16 with prompts longer
than a page; both sides count exactly the prompts' pages' bytes, and both pools are whole
after the drain. With NEXTN (V3's MTP layer) on both sides, the draft's KV and state cross
too. Every KV invariant is checked after every step (KVSTRATA_CHECK_INTEGRITY,
tests/conftest.py)."""
from __future__ import annotations

import pytest

from helpers.family_checks import random_prompts
from helpers.gemma_ckpt import hf_greedy
from helpers.moe_ckpt import VOCAB, hf_moe, moe_checkpoints
from kvstrata.config.server_args import ServerArgs
from kvstrata.engine.sides.registry import pd_side
from kvstrata.entrypoints.engine_factory import build_engine
from tests.correctness.test_sliding_window_models import check
from tests.correctness.test_swa_pd_engine import assert_bytes_crossed, run_pair
from tests.helpers.ports import free_port

ARCHS = ("deepseek_v3", "deepseek_v2_lite")
NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "temperature": 0}


@pytest.fixture(autouse=True)
def short_bootstrap(monkeypatch):
    """A room the decode never admits fails in seconds here, not after 300 s."""
    monkeypatch.setenv("KVSTRATA_DISAGG_BOOTSTRAP_TIMEOUT", "20")


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return moe_checkpoints(str(tmp_path_factory.mktemp("mla_pd")), ARCHS)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(11, (5, 17, 40), VOCAB)   # two cross a page of 16


@pytest.fixture(scope="module")
def references(paths, prompts) -> dict:
    return {a: hf_greedy(hf_moe(paths[a]), prompts, NEW_TOKENS) for a in ARCHS}


def engine(path, mode, port, page_size, **kw):
    args = ServerArgs(model_path=path, skip_tokenizer_init=True, dtype="float32",
                      disaggregation_mode=mode, disaggregation_bootstrap_port=port,
                      disaggregation_transfer_backend="tcp", page_size=page_size,
                      max_running_requests=8, max_total_tokens=1024, **kw)
    return build_engine(args)[0]


def whole(eng):
    """Nothing live, no room left, every page free or cached."""
    eng.check_integrity()
    sched = eng.scheduler
    assert not sched.live_requests() and not pd_side(sched).rooms
    kv = sched.kv
    assert kv.allocator.available_pages() + kv.tree.cached_pages() == kv.allocator.num_pages


def colocated_tokens(path, page_size, prompts) -> list[list[int]]:
    from kvstrata import LLM

    llm = LLM(model_path=path, skip_tokenizer_init=True, dtype="float32",
              page_size=page_size, max_total_tokens=1024)
    try:
        return [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch,page_size", [("deepseek_v3", 1), ("deepseek_v3", 16),
                                            ("deepseek_v2_lite", 16)])
def test_pd_greedy_equals_transformers_and_colocated(arch, page_size, paths, prompts,
                                                     references):
    path, port = paths[arch], free_port()
    prefill = engine(path, "prefill", port, page_size)
    decode = engine(path, "decode", free_port(), page_size)
    try:
        plan = decode.scheduler.config.plan
        assert plan.pool_kind == "mla" and [c.name for c in plan.components] == ["kv_latent"]
        outs = run_pair(prefill, decode, prompts, port, params=GREEDY)
        check(outs, references[arch], f"{arch} PD P={page_size}")
        assert outs == colocated_tokens(path, page_size, prompts)
        want = sum(-(-len(p) // page_size) for p in prompts) * plan.bytes_per_page
        assert_bytes_crossed(prefill, decode, want)
        for eng in (prefill, decode):
            whole(eng)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_pd_nextn_draft_state_crosses(paths, prompts, references, tmp_path):
    """NEXTN on both servers of a V3 pair (the MTP layer drafts over dense MLA): the
    prefill's draft-extend ships the MTP layer's latent pages (a second page buffer) and its
    hidden state, the decode's first draft rounds start from them; greedy tokens equal
    transformers' and both pools drain whole."""
    from helpers.moe_ckpt import add_v3_mtp_layer

    path, port = add_v3_mtp_layer(paths["deepseek_v3"], str(tmp_path / "mtp")), free_port()
    spec = dict(speculative_algorithm="NEXTN", speculative_disable_by_batch_size=1 << 20)
    prefill = engine(path, "prefill", port, 16, **spec)
    decode = engine(path, "decode", free_port(), 16, **spec)
    try:
        assert len(decode.runner.draft.page_buffers()) == 1  # the MTP layer's latent
        outs = run_pair(prefill, decode, prompts, port, params=GREEDY)
        check(outs, references["deepseek_v3"], "V3 PD NEXTN")
        assert decode.runner.draft.handoffs_used > 0
        for eng in (prefill, decode):
            whole(eng)
    finally:
        prefill.shutdown()
        decode.shutdown()
