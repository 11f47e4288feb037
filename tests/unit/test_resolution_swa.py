"""Hybrid SWA memory: the resolution rule (config/rules/swa.py: on, or off with a reason for
each combination kvstrata does not build over an SWA pool yet), the pool kind later rules see
(decode retraction), and the sizing of both pools (config/kv_sizing_swa.py)."""
from __future__ import annotations

import json

import pytest

from kvstrata.config import ModelInfo, ServerArgs, explain, resolve
from kvstrata.config.kv_plan import KVPlan, mha_components
from kvstrata.config.kv_sizing import (DEFAULT_MAX_RUNNING_REQUESTS, ModelKVFacts,
                                       size_kv_plan)
from kvstrata.config.rules import swa
from kvstrata.config.rules.retraction import decide_backup, inputs_from
from kvstrata.platform import simulated

HYBRID = ModelInfo.from_hf_config({"model_type": "qwen2", "num_hidden_layers": 4,
                                   "sliding_window": 128, "use_sliding_window": True,
                                   "max_window_layers": 1})
ALL_SWA = ModelInfo.from_hf_config({"model_type": "mistral", "num_hidden_layers": 4,
                                    "sliding_window": 128})
GEMMA2 = ModelInfo.from_hf_config({"model_type": "gemma2", "num_hidden_layers": 6})


def run(info=HYBRID, platform="cpu", **kw):
    resolved, res = resolve(ServerArgs(**kw), simulated(platform), info, env={})
    return resolved, {r.field: r for r in res}


def test_windows_from_config():
    assert HYBRID.layer_windows == (None, 128, 128, 128) and HYBRID.kv_pool_kind == "mha"
    assert ALL_SWA.num_full_layers == 0 and ALL_SWA.num_swa_layers == 4
    assert GEMMA2.layer_windows == (4096, None) * 3
    assert ModelInfo.from_hf_config({"model_type": "qwen2", "sliding_window": 8}
                                    ).layer_windows is None  # no use_sliding_window
    assert ModelInfo.from_hf_config({"model_type": "gpt_oss", "num_hidden_layers": 2,
                                     "sliding_window": 128, "layer_types": [
                                         "sliding_attention", "full_attention"]}
                                    ).layer_windows == (128, None)


@pytest.mark.parametrize("info,words", [(HYBRID, "3 windowed and 1 full-attention"),
                                        (ALL_SWA, "all 4 layers windowed"),
                                        (GEMMA2, "3 windowed and 3 full-attention")])
def test_on_by_default_for_windowed_models(info, words):
    resolved, res = run(info)
    assert resolved.hybrid_swa_memory is True
    assert res["hybrid_swa_memory"].rule == "swa.on" and words in res["hybrid_swa_memory"].reason


@pytest.mark.parametrize("info", [None, ModelInfo(), ModelInfo(kv_pool_kind="mla")])
def test_nothing_to_decide_without_windows(info):
    resolved, res = run(info)
    assert resolved.hybrid_swa_memory is None and "hybrid_swa_memory" not in res


@pytest.mark.parametrize("kw,reason", [
    (dict(disable_hybrid_swa_memory=True), "--disable-hybrid-swa-memory"),
])
@pytest.mark.parametrize("info", [HYBRID, ALL_SWA])
def test_off_with_the_reason(kw, reason, info):
    resolved, res = run(info, **kw)
    assert resolved.hybrid_swa_memory is False
    r = res["hybrid_swa_memory"]
    assert r.rule == "swa.off" and reason in r.reason, r.reason


@pytest.mark.parametrize("kw", [
    dict(speculative_algorithm="NGRAM"), dict(enable_deterministic_inference=True),
    dict(page_size=16), dict(disable_radix_cache=True), dict(swa_full_tokens_ratio=0.3),
    dict(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True),
    dict(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True,
         disaggregation_decode_enable_hicache=True),
    dict(disaggregation_mode="decode", disaggregation_decode_enable_offload_kvcache=True,
         hicache_storage_backend="file"),
    dict(chunked_prefill_size=64), dict(tp_size=2),
    dict(disaggregation_mode="decode", tp_size=2), dict(disaggregation_mode="prefill", tp_size=2)])
def test_allowed_combinations_stay_on(kw):
    """Each is exercised with the pool on: tests/correctness/test_swa_memory.py (the decode
    KV offload: test_swa_pd_engine.py)."""
    resolved, _ = run(**kw)
    assert resolved.hybrid_swa_memory is True


@pytest.mark.parametrize("info", [HYBRID, ALL_SWA])
@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE", "EAGLE3", "NEXTN"])
def test_draft_models_keep_it_on(algorithm, info):
    """A draft's pool (its K/V, an EAGLE head's features) sits over the full slots: beside a
    hybrid model's full pool, or as an all-SWA model's own draft slots (sized below; tested:
    test_swa_memory_engine.py, test_gpt_oss.py)."""
    kw = {} if algorithm == "NEXTN" else dict(speculative_draft_model_path="d")
    resolved, res = run(info, speculative_algorithm=algorithm, **kw)
    assert resolved.hybrid_swa_memory is True and res["hybrid_swa_memory"].rule == "swa.on"


def test_deterministic_default_covers_the_swa_pool():
    """On an AVX2 CPU at bf16 deterministic inference is on by default; the SWA pool kind
    later rules see must not turn it off (nor refuse the explicit flag)."""
    plat = simulated("cpu", cpu_flags=("avx2", "fma", "f16c"), cpu_threads=2)
    resolved, _ = resolve(ServerArgs(dtype="bfloat16"), plat, HYBRID, env={})
    assert resolved.hybrid_swa_memory and resolved.enable_deterministic_inference


def test_ratio_range():
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"--swa-full-tokens-ratio must be in \(0, 1\]"):
            ServerArgs(swa_full_tokens_ratio=bad)
    ServerArgs(swa_full_tokens_ratio=1.0)


# ---- the pool kind the decode-retraction rule sees -------------------------------------------
def test_later_rules_see_the_swa_kind():
    args, _ = run(max_total_tokens=4096)
    info = swa.model_info_after(args, HYBRID)
    assert (info.kv_pool_kind, info.full_attention_tokens_per_layer) == ("swa", 4096)
    args, _ = run(ALL_SWA)
    info = swa.model_info_after(args, ALL_SWA)
    assert (info.kv_pool_kind, info.full_attention_tokens_per_layer) == ("swa", 0)
    args, _ = run(disable_hybrid_swa_memory=True)
    assert swa.model_info_after(args, HYBRID) is HYBRID


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("backend", ["tcp", "mooncake"])
@pytest.mark.parametrize("info", [HYBRID, ALL_SWA])
def test_on_under_pd(mode, backend, info):
    """PD moves the last window's SWA pages (tests/unit/test_disagg_swa_pair.py,
    tests/transfer/test_disagg_swa_region.py): hybrid SWA memory stays on."""
    resolved, res = run(info, disaggregation_mode=mode,
                        disaggregation_transfer_backend=backend)
    assert resolved.hybrid_swa_memory is True and res["hybrid_swa_memory"].rule == "swa.on"


def test_retraction_with_the_real_pool_kinds():
    """SGLang's gate on the pool the swa rule leaves: a hybrid SWA pool takes host_pool (the
    full pages and the live window's SWA pages, runner/executors/retraction_backup.py); an
    all-SWA pool stays on cpu_tensor, saying why. An explicit host_pool keeps hybrid SWA
    memory on; for an all-SWA model it turns it off (one uniform pool) with that reason."""
    decode = ServerArgs(disaggregation_mode="decode", max_total_tokens=4096)
    args, _ = run(max_total_tokens=4096)
    hybrid = swa.model_info_after(args, HYBRID)
    pure = swa.model_info_after(run(ALL_SWA)[0], ALL_SWA)
    plat = simulated("cuda")
    from kvstrata.config.resolve_types import to_resolved
    backend, why = decide_backup(inputs_from(to_resolved(decode), plat, hybrid))
    assert backend == "host_pool" and "the live window's SWA pages" in why
    backend, why = decide_backup(inputs_from(to_resolved(decode), plat, pure))
    assert backend == "cpu_tensor" and "no full-attention pages" in why
    for info, want in ((HYBRID, "host_pool"), (ALL_SWA, "cpu_tensor")):
        resolved, res = run(info, "cuda", disaggregation_mode="decode")
        assert resolved.hybrid_swa_memory is True
        assert resolved.disaggregation_decode_retraction_backup == want
        assert res["disaggregation_decode_retraction_backup"].rule == "retraction.backup"
    explicit = dict(disaggregation_mode="decode",
                    disaggregation_decode_retraction_backup="host_pool")
    assert run(HYBRID, "cuda", **explicit)[0].hybrid_swa_memory is True
    resolved, res = run(ALL_SWA, "cuda", **explicit)
    assert resolved.hybrid_swa_memory is False
    assert "host_pool with an all-SWA model" in res["hybrid_swa_memory"].reason


def test_explain_shows_the_decision():
    text = explain(ServerArgs(), simulated("cpu"), HYBRID)
    assert "swa.on" in text and "hybrid_swa_memory = True" in text
    # (HiCache L3 keeps it on beside full layers: cache/swa_storage.py; an all-SWA model
    # has no full-layer pool for the host tier to copy)
    for info, rule in ((HYBRID, "swa.on"), (ALL_SWA, "swa.off")):
        data = json.loads(explain(ServerArgs(enable_hierarchical_cache=True,
                                             hicache_storage_backend="file"),
                                  simulated("cpu"), info, as_json=True))
        assert [r["rule"] for r in data["resolutions"]
                if r["field"] == "hybrid_swa_memory"] == [rule]


def test_decode_offload_of_an_all_swa_model_is_its_host_tier():
    """The decode KV offload turns HiCache on (rule disagg.decode_offload), so an all-SWA
    model gets one uniform pool for the HiCache reason; a hybrid one keeps its SWA pool."""
    kw = dict(disaggregation_mode="decode", disaggregation_decode_enable_offload_kvcache=True,
              hicache_storage_backend="file")
    assert run(HYBRID, **kw)[0].hybrid_swa_memory is True
    resolved, res = run(ALL_SWA, **kw)
    assert resolved.hybrid_swa_memory is False
    assert "HiCache with an all-SWA model" in res["hybrid_swa_memory"].reason


@pytest.mark.parametrize("storage", [{}, dict(hicache_storage_backend="file")])
def test_hicache_keeps_it_on_with_full_layers_only(storage):
    """The host tier (cache/swa_hiradix.py) and storage (cache/swa_storage.py) copy SWA
    pages beside a full-layer pool; an all-SWA model has none for the host tier to copy, so
    it stays off there, with that reason."""
    resolved, res = run(HYBRID, enable_hierarchical_cache=True, **storage)
    assert resolved.hybrid_swa_memory is True
    resolved, res = run(ALL_SWA, enable_hierarchical_cache=True, **storage)
    assert resolved.hybrid_swa_memory is False
    assert "all-SWA model" in res["hybrid_swa_memory"].reason


# ---- sizing -------------------------------------------------------------------------------
def facts(windows, heads=2, dim=16, dtype="float32", draft=()):
    return ModelKVFacts("mha", mha_components(len(windows), heads, dim, dtype), 4096,
                        layer_windows=tuple(windows), draft_components=draft)


def size(windows, budget=None, info=HYBRID, **kw):
    args, _ = run(info, **kw)
    return size_kv_plan(args, facts(windows), budget)


def test_hybrid_formula():
    # one layer's K+V per token: 2 x 2 heads x 16 x 4 B = 256 B; 1 full + 3 windowed layers
    plan, res = size((None, 128, 128, 128), budget=10 * 2**20, page_size=16)
    cell = 256 * 1 + 0.8 * 256 * 3
    full = int(10 * 2**20 // cell) // 16 * 16
    assert plan.pool_kind == "swa" and plan.max_total_tokens == full
    assert plan.max_swa_tokens == int(full * 0.8) // 16 * 16 and plan.swa_window == 128
    assert plan.component("k").num_layers == 1 and plan.swa_components[0].num_layers == 3
    assert plan.device_pool_bytes <= 10 * 2**20 + 2 * 16 * 1024  # + the two padding pages
    r = {x.field: x for x in res}["max_total_tokens"]
    assert r.rule == "kv_plan.swa_memory" and "0.8 x" in r.reason
    # vs one uniform pool at the same budget: 10 MiB / 1024 B per token
    uniform, _ = size((None, 128, 128, 128), budget=10 * 2**20, page_size=16,
                      disable_hybrid_swa_memory=True)
    assert uniform.pool_kind == "mha" and uniform.max_total_tokens == 10 * 2**20 // 1024
    assert plan.max_total_tokens > uniform.max_total_tokens  # (1 + 0.8 * 3) / 4 of a token


def test_max_total_tokens_names_the_full_pool():
    plan, _ = size((None, 128, 128, 128), max_total_tokens=1000, page_size=16,
                   swa_full_tokens_ratio=0.5)
    assert plan.max_total_tokens == 992 and plan.max_swa_tokens == 496


def test_all_swa_gives_the_budget_to_the_swa_pool():
    plan, res = size((128,) * 4, budget=2**20, info=ALL_SWA, swa_full_tokens_ratio=0.5,
                     max_running_requests=8, context_length=1000)
    assert plan.components == () and plan.max_swa_tokens == 2**20 // 1024
    assert plan.num_pages == 8 * 1000  # canonical ids: rows x context
    assert plan.device_pool_bytes == (plan.num_swa_pages + 1) * 1024
    assert plan.dtype == "float32" and "SWA pool" in plan.summary()
    assert {x.field: x for x in res}["max_total_tokens"].new == 1024


def test_all_swa_with_a_draft_sizes_the_draft_slots():
    """An all-SWA target's full page ids get the draft's K/V behind them: the budget splits
    like a hybrid model's with no full layer (cell = draft + r x SWA); --max-total-tokens
    names the draft's slots."""
    draft = mha_components(1, 2, 16, "float32")  # 256 B per token
    args, _ = run(ALL_SWA, page_size=16, swa_full_tokens_ratio=0.5,
                  speculative_algorithm="STANDALONE", speculative_draft_model_path="d")
    plan, res = size_kv_plan(args, facts((128,) * 4, draft=draft), 2**20)
    cell = 256 + 0.5 * 1024
    assert plan.components == () and plan.draft_components == draft
    assert plan.max_total_tokens == int(2**20 // cell) // 16 * 16
    assert plan.max_swa_tokens == int(plan.max_total_tokens * 0.5) // 16 * 16
    assert plan.draft_plan().num_pages == plan.num_pages  # the draft's slots: memory-bound
    assert plan.num_rows == min(DEFAULT_MAX_RUNNING_REQUESTS, plan.num_pages)
    assert "draft's slots" in {x.field: x for x in res}["max_total_tokens"].reason
    args, _ = run(ALL_SWA, max_total_tokens=1000, page_size=16, swa_full_tokens_ratio=0.5,
                  speculative_algorithm="STANDALONE", speculative_draft_model_path="d")
    plan, _ = size_kv_plan(args, facts((128,) * 4, draft=draft))
    assert (plan.max_total_tokens, plan.max_swa_tokens) == (992, 496)


@pytest.mark.parametrize("windows,kw,budget", [
    ((None, 128, 128, 128), dict(max_total_tokens=160, page_size=16), None),   # 128 <= 144
    ((None, 128, 128, 128), dict(max_total_tokens=4096, swa_full_tokens_ratio=0.03), None),
    ((128,) * 4, dict(page_size=16), 144 * 1024),                             # all-SWA
    ((None, 128, 128, 128), {}, 100 * 1024)])
def test_refuses_an_swa_pool_below_one_window(windows, kw, budget):
    info = HYBRID if None in windows else ALL_SWA
    with pytest.raises(ValueError, match="cannot hold even one request"):
        size(windows, budget, info, **kw)
    size(windows, budget, info, **{**kw, "disable_hybrid_swa_memory": True})  # fits uniform


def test_plan_checks_and_json():
    comps = mha_components(2, 2, 16, "float32")
    with pytest.raises(ValueError, match="an swa pool keeps"):
        KVPlan(1, 10, 4, 64, "swa", comps)  # no SWA pool
    plan = KVPlan(16, 10, 4, 64, "swa", comps, num_swa_pages=5, swa_window=32,
                  swa_components=comps)
    data = plan.to_json()
    assert (data["num_swa_pages"], data["max_swa_tokens"], data["swa_window"]) == (5, 80, 32)
    assert plan.full_pool_plan().pool_kind == "mha" and plan.swa_pool_plan().num_pages == 5
