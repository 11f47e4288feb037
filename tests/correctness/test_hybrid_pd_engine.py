"""Hybrid recurrent models across PD with real runners, in one process: a prefill and a decode
EngineCore (the server's engine factory, --disaggregation-mode prefill / decode, tcp or
mooncake on 127.0.0.1) stepped in turn. The prefill streams the attention layers' pages and,
on the last chunk, the request's final state slot (cache/state_pd.py, a third page region:
transfer/disagg/regions.py); the decode receives it into a state slot of its own and decodes
from it. Greedy tokens must equal transformers'; the byte counters of both sides equal the
pages' K/V plus one state slot per request; a pressured decode retracts (cpu_tensor: the K/V
pages and the state slot backed up) and restores exactly. Every KV and state-slot invariant
is checked after every step (KVSTRATA_CHECK_INTEGRITY, tests/conftest.py) and both engines'
pools and state slots are whole after the drain."""
from __future__ import annotations

import pytest

from kvstrata.config.server_args import ServerArgs
from kvstrata.engine.sides.registry import pd_side
from kvstrata.entrypoints.engine_factory import build_engine
from tests.correctness.test_hybrid_engine import (  # noqa: F401 (fixtures)
    GREEDY, paths, prompts, ref)
from tests.correctness.test_swa_pd_engine import assert_bytes_crossed, run_pair
from tests.helpers.ports import free_port


@pytest.fixture(autouse=True)
def short_bootstrap(monkeypatch):
    """A room the decode never admits fails within a minute here, not after 300 s."""
    monkeypatch.setenv("KVSTRATA_DISAGG_BOOTSTRAP_TIMEOUT", "60")


def engine(path, mode, port, page_size, backend="tcp", **kw):
    args = ServerArgs(model_path=path, skip_tokenizer_init=True, dtype="float32",
                      disaggregation_mode=mode, disaggregation_bootstrap_port=port,
                      disaggregation_transfer_backend=backend, page_size=page_size,
                      max_running_requests=8, max_mamba_cache_size=24, **kw)
    return build_engine(args)[0]


def whole(eng):
    eng.check_integrity()
    sched = eng.scheduler
    assert not sched.live_requests() and not pd_side(sched).rooms
    states = sched.kv.states
    assert states.allocator.available_pages() + states.tree.cached_states() == states.num_slots


def pair(path, page_size, chunk, backend="tcp", kv_tokens=2048, **decode_kw):
    port = free_port()
    kv = {} if "mamba2" in path else {"max_total_tokens": kv_tokens}
    prefill = engine(path, "prefill", port, page_size, backend, chunked_prefill_size=chunk,
                     **({"max_total_tokens": 2048} if kv else {}))
    decode = engine(path, "decode", free_port(), page_size, backend, **kv, **decode_kw)
    return prefill, decode, port


@pytest.mark.parametrize("arch,page_size,chunk,backend", [
    ("qwen3_5", 1, 7, "tcp"), ("nemotron_h", 16, 32, "tcp"), ("mamba2", 16, -1, "tcp"),
    ("qwen3_next", 16, 16, "mooncake")])
def test_pd_greedy_equals_transformers(arch, page_size, chunk, backend, paths, prompts, ref):
    """The prompts' pages cross in chunks and the final state slot with the last; Mamba2
    keeps no K/V, so only its state slots cross. Both sides count exactly the K/V of every
    prompt page and one state slot a request."""
    prefill, decode, port = pair(paths[arch], page_size, chunk, backend)
    try:
        plan = decode.scheduler.config.plan
        assert decode.scheduler.config.max_running_requests == 8
        outs = run_pair(prefill, decode, prompts, port, params=GREEDY)
        for p, got in zip(prompts, outs):
            assert got == ref(arch)(p), f"{arch} PD P={page_size}"
        pages = 0 if arch == "mamba2" else sum(-(-len(p) // page_size) for p in prompts)
        want = pages * plan.bytes_per_page + len(prompts) * plan.state_bytes_per_slot
        assert_bytes_crossed(prefill, decode, want)
        for eng in (prefill, decode):
            whole(eng)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("arch,page_size,kv_tokens,spec", [("granite", 16, 128, True),
                                                           ("qwen3_next", 1, 120, False)])
def test_pressured_decode_retracts_and_restores_exactly(arch, page_size, kv_tokens, spec, paths,
                                                        prompts, ref):
    """A decode K/V pool too small for the batch's decodes: it retracts with cpu_tensor (the
    auto rule's pick for a recurrent model), each backup keeping the request's K/V pages and
    its state slot, restored into a new slot; transformers' tokens. Granite's decode also
    verifies NGRAM drafts (each verify commits the accepted step into the received slot)."""
    batch = prompts + [p[::-1] for p in prompts[1:3]]
    ngram = {"speculative_algorithm": "NGRAM", "speculative_disable_by_batch_size": 1 << 20}
    prefill, decode, port = pair(paths[arch], page_size, -1, kv_tokens=kv_tokens,
                                 num_reserved_decode_tokens=1, **(ngram if spec else {}))
    params = {**GREEDY, "max_new_tokens": 24}
    try:
        assert decode.scheduler.config.retraction_backup == "cpu_tensor"
        outs = run_pair(prefill, decode, batch, port, params=params)
        for p, got in zip(batch, outs):
            assert got == ref(arch)(p, 24), f"{arch} PD retracted"
        side = pd_side(decode.scheduler)
        backups = side.retraction.num_backups["cpu_tensor"]
        assert backups >= 1 and side.retraction.num_restores["cpu_tensor"] == backups
        if spec:
            assert decode.get_load()["spec_verify_steps"] > 0
        stats = decode.runner.backup.stats()
        assert stats["state_backup_count"] == stats["state_restore_count"] == backups
        assert stats["held_backups"] == 0
        for eng in (prefill, decode):
            whole(eng)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_decode_radix_cache_is_refused(paths):
    """SGLang refuses the decode radix cache for Mamba/SSM models; so does kvstrata."""
    with pytest.raises(ValueError, match="incompatible with Mamba/SSM models"):
        engine(paths["qwen3_5"], "decode", free_port(), 1, max_total_tokens=512,
               disaggregation_decode_enable_radix_cache=True)


_mtp_paths: dict[str, str] = {}


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    """A tiny Qwen3-Next or Qwen3.5 with an MTP layer that drafts well
    (test_speculative_mtp_hybrid.py), built once per arch."""
    from helpers.hybrid_ckpt import build_hybrid_checkpoint
    from tests.correctness.test_speculative_mtp_hybrid import add_mtp_layer

    def get(arch: str) -> str:
        if arch not in _mtp_paths:
            root = tmp_path_factory.mktemp(f"{arch}_mtp_pd")
            _mtp_paths[arch] = add_mtp_layer(build_hybrid_checkpoint(arch, str(root / arch)))
        return _mtp_paths[arch]
    yield get
    _mtp_paths.clear()


@pytest.mark.parametrize("arch,page_size,kv_tokens,backend", [
    ("qwen3_next", 16, 2048, "tcp"), ("qwen3_next", 1, 120, "tcp"),
    ("qwen3_5", 1, 120, "tcp"), ("qwen3_next", 16, 2048, "mooncake")])
def test_pd_nextn(arch, page_size, kv_tokens, backend, mtp_path, prompts):
    """NEXTN on both servers of a Qwen3-Next / Qwen3.5 pair: beside the K/V pages and the final
    state slot, the MTP layer's K/V pages (a second page buffer) and its hidden state cross
    (tcp or mooncake), and every decode's first draft round starts from them. With a decode
    pool too small for the batch (120 tokens) it also retracts and restores (K/V, draft K/V,
    state slot) exactly. transformers' tokens; drafts accepted; pools and state slots
    whole."""
    from helpers.hybrid_ckpt import HFGreedy

    path = mtp_path(arch)
    spec = {"speculative_algorithm": "NEXTN", "speculative_disable_by_batch_size": 1 << 20}
    pressured = kv_tokens < 2048
    batch = prompts + [p[::-1] for p in prompts[1:3]] if pressured else prompts
    port = free_port()
    prefill = engine(path, "prefill", port, page_size, backend, chunked_prefill_size=16,
                     max_total_tokens=2048, **spec)
    decode = engine(path, "decode", free_port(), page_size, backend,
                    max_total_tokens=kv_tokens, **spec,
                    **({"num_reserved_decode_tokens": 1} if pressured else {}))
    new = 24 if pressured else GREEDY["max_new_tokens"]
    try:
        assert type(prefill.runner.draft).__name__ == "Qwen3NextMTPDraft"
        outs = run_pair(prefill, decode, batch, port, params={**GREEDY, "max_new_tokens": new})
        reference = HFGreedy(path)
        for p, got in zip(batch, outs):
            assert got == reference(p, new), f"{arch} PD NEXTN"
        assert decode.runner.draft.handoffs_used > 0
        load = decode.get_load()
        # accepted tokens count one per verify plus its accepted drafts: some drafts passed
        assert load["spec_accepted_tokens"] > load["spec_verify_steps"] > 0
        if pressured:
            side = pd_side(decode.scheduler)
            backups = side.retraction.num_backups["cpu_tensor"]
            assert backups >= 1 and side.retraction.num_restores["cpu_tensor"] == backups
        for eng in (prefill, decode):
            whole(eng)
    finally:
        prefill.shutdown()
        decode.shutdown()
