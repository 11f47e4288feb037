"""KVPlan and sizing without torch: geometry helpers for every pool kind, the one validation,
sizing from flags or a memory budget, the page-geometry rule, and the scheduler's config."""
from __future__ import annotations

import dataclasses

import pytest

from kvstrata.config import ServerArgs, resolve
from kvstrata.config.kv_plan import (DSA_INDEX_K, EAGLE_HIDDEN, IO_BACKEND_LAYOUTS,
                                     MLA_LATENT, KVComponent, KVPlan, mha_components)
from kvstrata.config.kv_sizing import ModelKVFacts, size_kv_plan
from kvstrata.engine.scheduler.core import SchedulerConfig

# SmolLM2-135M: 30 layers, 3 kv heads of 64, float32.
SMOL = ModelKVFacts("mha", mha_components(30, 3, 64, "float32"), max_position_embeddings=8192)


def resolved(**kw):
    return resolve(ServerArgs(**kw), "cpu")[0]


def test_mha_bytes_per_token_and_per_page_per_layer():
    plan = KVPlan(16, 10, 4, 2048, "mha", SMOL.components)
    assert plan.bytes_per_token == 30 * 3 * 64 * 2 * 4 == 46080
    assert plan.bytes_per_page == 16 * 46080
    assert plan.device_pool_bytes == 11 * 16 * 46080  # + the padding page
    assert plan.bytes_per_page_per_layer("k") == plan.bytes_per_page_per_layer("v") == 16 * 768
    assert plan.num_layers == 30 and plan.dtype == "float32" and plan.max_total_tokens == 160


def test_mla_and_dsa_indexer_fit_the_plan():
    """DeepSeek-V3.2-like: a 576-wide bf16 latent and a 128-dim fp8 indexer key with one
    fp32 scale per 128 elements, both in 61 layers, 64-token pages."""
    latent = KVComponent(MLA_LATENT, 61, (1, 512 + 64), "bfloat16")
    index_k = KVComponent(DSA_INDEX_K, 61, (128 + 128 // 128 * 4,), "uint8")
    plan = KVPlan(64, 100, 8, 4096, "mla", (latent, index_k))
    assert plan.bytes_per_page_per_layer(MLA_LATENT) == 64 * 576 * 2
    assert plan.bytes_per_page_per_layer(DSA_INDEX_K) == 64 * 132 == 8448  # SGLang's figure
    assert plan.bytes_per_token == 61 * (576 * 2 + 132)
    with pytest.raises(KeyError, match="no 'k' component"):
        plan.component("k")


@pytest.mark.parametrize("bad, match", [
    (dict(page_size=0), "page_size must be >= 1"),
    (dict(num_pages=0), "num_pages must be >= 1"),
    (dict(num_rows=0), "num_rows must be >= 1"),
    (dict(pool_kind="mla"), "a mla pool keeps"),
    (dict(num_host_pages=4), "needs a host layout and an IO backend"),
    (dict(num_host_pages=4, host_layout="page_head", io_backend="direct"),
     "--hicache-io-backend direct cannot move a --hicache-mem-layout page_head"),
    (dict(num_host_pages=4, host_layout="nope", io_backend="kernel"), "unknown host memory"),
])
def test_plan_validates_once(bad, match):
    fields = dict(page_size=4, num_pages=8, num_rows=2, context_len=64, pool_kind="mha",
                  components=mha_components(2, 1, 8, "float32"))
    with pytest.raises(ValueError, match=match):
        KVPlan(**{**fields, **bad})


def test_layout_io_table_is_the_resolvers():
    """Every pair the resolver leaves standing is one the IO backends can move."""
    for layout in ("layer_first", "page_first", "page_first_direct", "page_head"):
        for io in ("kernel", "direct"):
            try:
                args = resolved(enable_hierarchical_cache=True, hicache_mem_layout=layout,
                                hicache_io_backend=io)
            except ValueError:
                assert layout not in IO_BACKEND_LAYOUTS[io]
                continue
            assert args.hicache_mem_layout in IO_BACKEND_LAYOUTS[args.hicache_io_backend]


def test_sizing_from_flags_rounds_to_whole_pages():
    args = resolved(page_size=16, max_total_tokens=1000, max_running_requests=8,
                    context_length=512)
    plan, res = size_kv_plan(args, SMOL)
    assert (plan.num_pages, plan.max_total_tokens, plan.num_rows, plan.context_len) == \
        (62, 992, 8, 512)
    assert [(r.field, r.old, r.new, r.rule) for r in res] == [
        ("max_total_tokens", 1000, 992, "kv_plan.whole_pages")]
    assert plan.host_layout is None and not plan.has_host_pool


def test_sizing_from_budget_fills_in_and_records_every_default():
    plan, res = size_kv_plan(resolved(page_size=4), SMOL, budget_bytes=46080 * 1003)
    assert plan.max_total_tokens == 1000 and plan.num_rows == 250  # min(256, 250 pages)
    assert plan.context_len == 8192
    by = {r.field: r for r in res}
    assert by["max_total_tokens"].rule == "kv_plan.memory_budget"
    assert by["max_running_requests"].new == 250 and by["context_length"].new == 8192


def test_budget_below_one_page_is_a_clear_error():
    with pytest.raises(ValueError, match="less than one page of --page-size 16.*"
                                         "--mem-fraction-static or set --max-total-tokens"):
        size_kv_plan(resolved(page_size=16), SMOL, budget_bytes=46080 * 15)


def test_sliding_window_caps_context_with_a_warning_resolution():
    facts = dataclasses.replace(SMOL, sliding_window=128)
    plan, res = size_kv_plan(resolved(max_total_tokens=64), facts)
    assert plan.context_len == 128
    (r,) = [r for r in res if r.field == "context_length"]
    assert r.warning and r.rule == "kv_plan.sliding_window" and r.new == 128


def test_host_pool_sized_from_ratio():
    args = resolved(page_size=4, max_total_tokens=400, enable_hierarchical_cache=True,
                    hicache_ratio=2.5, hicache_mem_layout="page_first_direct",
                    hicache_io_backend="direct")
    plan, _ = size_kv_plan(args, SMOL)
    assert (plan.num_host_pages, plan.host_layout, plan.io_backend) == \
        (250, "page_first_direct", "direct")
    assert plan.host_pool_bytes == 251 * 4 * 46080
    assert plan.to_json()["num_host_pages"] == 250


def test_a_draft_pool_is_sized_beside_the_target_in_one_budget():
    """STANDALONE: every slot holds target and draft KV, so a token costs both; the host
    tier holds target pages only."""
    draft = mha_components(2, 1, 64, "float32")  # 1024 B/token
    facts = dataclasses.replace(SMOL, draft_components=draft)
    plan, _ = size_kv_plan(resolved(page_size=4, enable_hierarchical_cache=True,
                                    hicache_ratio=2.0), facts, budget_bytes=47104 * 1000)
    assert plan.max_total_tokens == 1000 and plan.draft_bytes_per_token == 1024
    assert plan.host_pool_bytes == (plan.num_host_pages + 1) * 4 * 46080
    sub = plan.draft_plan()
    assert (sub.num_pages, sub.page_size, sub.components, sub.num_host_pages) == \
        (plan.num_pages, 4, draft, 0)
    assert plan.to_json()["draft_bytes_per_token"] == 1024 and "draft pool" in plan.summary()
    with pytest.raises(ValueError, match="has no draft pool"):
        size_kv_plan(resolved(max_total_tokens=64), SMOL)[0].draft_plan()


def test_an_eagle_head_keeps_a_feature_per_token_beside_its_kv():
    """EAGLE: the head's K/V plus the target's hidden state per slot, in the same budget;
    the head's pool is built from its K/V only."""
    kv = mha_components(1, 1, 64, "float32")  # 512 B/token
    draft = kv + (KVComponent(EAGLE_HIDDEN, 1, (576,), "float32"),)  # + 2304 B/token
    facts = dataclasses.replace(SMOL, draft_components=draft)
    plan, _ = size_kv_plan(resolved(page_size=4), facts, budget_bytes=(46080 + 2816) * 1000)
    assert plan.max_total_tokens == 1000 and plan.draft_bytes_per_token == 2816
    assert plan.draft_plan().components == kv
    with pytest.raises(ValueError, match="a draft pool keeps"):
        dataclasses.replace(plan, draft_components=draft[::-1])


# ---- start-up validation of chunk and pool sizes vs the page (rules/page_geometry.py) ------
def test_chunk_smaller_than_a_page_is_refused_naming_both_flags():
    # Accepted before, then the prefill hung: a chunk is cut to whole pages, i.e. to nothing.
    with pytest.raises(ValueError, match="--chunked-prefill-size 8 must be a multiple of "
                                         "--page-size 16"):
        resolved(page_size=16, max_total_tokens=16, chunked_prefill_size=8)


def test_chunk_not_a_multiple_of_the_page_is_refused_like_sglang():
    with pytest.raises(ValueError, match="--chunked-prefill-size 24 must be a multiple"):
        resolved(page_size=16, chunked_prefill_size=24)
    # ... except on a decode server, which never prefills in chunks (as in SGLang).
    assert resolved(page_size=16, chunked_prefill_size=24,
                    disaggregation_mode="decode").chunked_prefill_size == 24


@pytest.mark.parametrize("chunk", [16, 32, -1])
def test_page_multiples_and_disabled_chunking_pass(chunk):
    assert resolved(page_size=16, chunked_prefill_size=chunk).chunked_prefill_size == chunk


@pytest.mark.parametrize("page_size, expected", [(3, 2046), (16, 2048), (4096, 4096)])
def test_platform_default_chunk_is_page_aligned(page_size, expected):
    args, res = resolve(ServerArgs(page_size=page_size), "cpu")
    assert args.chunked_prefill_size == expected
    (r,) = [r for r in res if r.field == "chunked_prefill_size"]
    assert ("aligned to whole pages" in r.reason) == (expected != 2048)


def test_max_total_tokens_below_one_page_is_refused():
    with pytest.raises(ValueError, match="--max-total-tokens 8 is less than one page "
                                         r"\(--page-size 16\)"):
        resolved(page_size=16, max_total_tokens=8)
    assert resolved(page_size=16, max_total_tokens=16).max_total_tokens == 16


# ---- the scheduler's config reads the plan --------------------------------------------------
def test_scheduler_config_from_args_and_plan():
    args = resolved(page_size=4, max_total_tokens=64, schedule_policy="lpm",
                    chunked_prefill_size=8, disable_radix_cache=True)
    plan, _ = size_kv_plan(args, SMOL)
    cfg = SchedulerConfig.from_args(args, plan)
    assert cfg.plan is plan and (cfg.page_size, cfg.num_pages, cfg.max_running_requests) == \
        (4, 16, 16)
    assert (cfg.schedule_policy, cfg.chunked_prefill_size, cfg.disable_radix_cache) == \
        ("lpm", 8, True)


def test_scheduler_config_for_tests_builds_a_page_only_plan():
    cfg = SchedulerConfig(num_pages=12, page_size=2, max_running_requests=3, num_host_pages=5)
    assert cfg.plan.pool_kind == "none" and cfg.plan.num_rows == 3 and cfg.num_host_pages == 5
    with pytest.raises(TypeError, match="needs a KVPlan, or num_pages"):
        SchedulerConfig()
    with pytest.raises(TypeError, match="unknown SchedulerConfig field"):
        SchedulerConfig(num_pages=4, schedule_polcy="lpm")


# ---- the recurrent-state half (config/state_plan.py) ---------------------------------------
def test_state_pool_counts_every_component_of_every_layer_and_the_padding_slot():
    from kvstrata.config.state_plan import StateComponent
    conv = StateComponent("conv", 3, (96, 3), "float32")      # 3 layers x 96 x 3 x 4 B
    ssm = StateComponent("ssm", 3, (4, 8, 8), "bfloat16")     # 3 layers x 256 x 2 B
    plan = dataclasses.replace(KVPlan.mha(num_layers=1, num_kv_heads=1, head_dim=4,
                                          dtype="float32", page_size=1, num_pages=8),
                               num_state_slots=5, state_components=(conv, ssm))
    assert plan.state_bytes_per_slot == 3 * 96 * 3 * 4 + 3 * 256 * 2
    assert plan.state_pool_bytes == 6 * plan.state_bytes_per_slot and plan.has_state_pool
    assert plan.to_json()["num_state_slots"] == 5 and "state pool 5 slots" in plan.summary()


@pytest.mark.parametrize("slots, comps, match", [
    (-1, (), "num_state_slots must be >= 0"),
    (0, ("ssm",), "state components without a state pool"),
    (2, ("conv",), "keeps an 'ssm' component"),
    (2, ("ssm", "ssm"), "duplicate state components"),
])
def test_state_pool_refuses_an_ill_formed_half(slots, comps, match):
    from kvstrata.config.state_plan import StateComponent
    comp = tuple(StateComponent(n, 1, (2, 2), "float32") for n in comps)
    with pytest.raises(ValueError, match=match):
        KVPlan(1, 4, 4, 64, "none", (), num_state_slots=slots, state_components=comp)
    with pytest.raises(ValueError, match="invalid state component"):
        StateComponent("ssm", 1, (0, 2), "float32")
