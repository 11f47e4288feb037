"""HiCache L2 end to end on a tiny model: a device pool far smaller than a multi-turn working
set, for every valid layout x IO backend x write policy, gives exactly the greedy tokens of a
large pool without HiCache (the KV round-trips bit-exactly), which in turn match transformers."""
from __future__ import annotations

import pytest

from helpers.compare import assert_match_transformers

VALID_PAIRS = [("layer_first", "kernel"), ("page_first", "kernel"), ("page_head", "kernel"),
               ("layer_first", "direct"), ("page_first_direct", "direct")]
POLICIES = ["write_through", "write_through_selective", "write_back"]
ANSWER = 6
GREEDY = {"max_new_tokens": ANSWER, "min_new_tokens": ANSWER, "temperature": 0}


def assert_host_tier_served(llm) -> None:
    """Pages were demoted to the host pool and loaded back, and every pool is whole."""
    load = llm.get_load()
    assert load["hicache_host_hit_tokens"] > 0, load
    assert load["hicache_demoted_pages"] > 0 and load["hicache_h2d_pages"] > 0, load
    llm.check_integrity()


def multi_turn(llm, conversations=3, turns=5, system_len=40, user_len=9, vocab=300):
    system = [(7 * i + 3) % (vocab - 3) + 3 for i in range(system_len)]
    history = {c: list(system) for c in range(conversations)}
    prompts, outputs = [], []
    for t in range(turns):
        for c in range(conversations):
            history[c] += [(c * 97 + t * 31 + i * 13) % (vocab - 3) + 3 for i in range(user_len)]
            out = llm.generate(input_ids=list(history[c]), sampling_params=GREEDY)
            prompts.append(list(history[c]))
            outputs.append(out["output_ids"])
            history[c] += out["output_ids"]
    return prompts, outputs


def make_llm(path, **kw):
    from kvstrata import LLM

    return LLM(model_path=path, skip_tokenizer_init=True, page_size=kw.pop("page_size", 4), **kw)


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    """Large pool, no HiCache; checked against transformers once."""
    path = tiny_checkpoints["llama"]
    llm = make_llm(path, max_total_tokens=8192)
    try:
        prompts, outputs = multi_turn(llm)
    finally:
        llm.shutdown()
    assert_match_transformers(path, prompts, outputs, label="no-hicache vs transformers")
    return prompts, outputs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("layout,io", VALID_PAIRS)
def test_starved_pool_with_hicache_matches(layout, io, policy, tiny_checkpoints, reference):
    _, expected = reference
    llm = make_llm(tiny_checkpoints["llama"], max_total_tokens=160,
                   enable_hierarchical_cache=True, hicache_mem_layout=layout,
                   hicache_io_backend=io, hicache_write_policy=policy, hicache_size=0,
                   hicache_ratio=8.0)
    try:
        _, outputs = multi_turn(llm)
        assert outputs == expected
        assert_host_tier_served(llm)
    finally:
        llm.shutdown()


def test_host_exhaustion_degrades_to_recompute(tiny_checkpoints, reference):
    _, expected = reference
    llm = make_llm(tiny_checkpoints["llama"], max_total_tokens=160,
                   enable_hierarchical_cache=True, hicache_write_policy="write_back",
                   hicache_ratio=0.2)
    try:
        _, outputs = multi_turn(llm)
        assert outputs == expected
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_l2_option_without_hicache_is_refused(tiny_checkpoints):
    with pytest.raises(ValueError, match="--hicache-write-policy needs --enable-hierarchical-cache"):
        make_llm(tiny_checkpoints["llama"], hicache_write_policy="write_back")


def test_storage_tier_serves_prefixes_after_a_flush(tiny_checkpoints, reference):
    """HiCache L3 (memory backend): after a first pass, the device and host tiers are
    flushed (what a restart leaves), yet the store keeps the pages; the second pass
    prefetches its prefixes from storage, loads them back, and the tokens are unchanged."""
    _, expected = reference
    llm = make_llm(tiny_checkpoints["llama"], max_total_tokens=160,
                   enable_hierarchical_cache=True, hicache_size=0, hicache_ratio=4.0,
                   hicache_storage_backend="memory", hicache_storage_prefetch_policy="wait_complete",
                   hicache_storage_backend_extra_config='{"prefetch_threshold": 8}')
    try:
        assert multi_turn(llm)[1] == expected
        assert llm.engine.finish_storage_backups(timeout=30) and llm.flush_cache()
        before = llm.get_load()
        assert before["hicache_host_used_tokens"] == 0
        assert multi_turn(llm)[1] == expected
        load = llm.get_load()
        assert load["hicache_storage_hit_tokens"] > 0, load
        assert load["hicache_storage_bytes_read"] > 0 and load["hicache_storage_errors"] == 0
        assert load["hicache_host_hit_tokens"] > before["hicache_host_hit_tokens"]
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_second_engine_on_a_file_store_matches_a_cold_run(tiny_checkpoints, reference,
                                                          tmp_path):
    """Needs the `file` backend (kvstrata/kv/storage/file_store.py, merged from the storage
    branch). A second engine with fresh device and host pools serves the shared prefix from
    the store the first one wrote, with the tokens of a cold run."""
    pytest.importorskip("kvstrata.kv.storage.file_store")
    prompts, expected = reference
    extra = f'{{"file_path": "{tmp_path}", "prefetch_threshold": 8}}'
    kw = dict(max_total_tokens=8192, enable_hierarchical_cache=True, hicache_size=0,
              hicache_ratio=2.0, hicache_storage_backend="file",
              hicache_storage_prefetch_policy="wait_complete",
              hicache_storage_backend_extra_config=extra)
    for round_ in range(2):
        llm = make_llm(tiny_checkpoints["llama"], **kw)
        try:
            out = llm.generate(input_ids=prompts[-1], sampling_params=GREEDY)
            assert out["output_ids"] == expected[-1], round_
            load = llm.get_load()
        finally:
            llm.shutdown()  # finishes the backups
        if round_ == 1:
            assert load["hicache_storage_hit_tokens"] >= len(prompts[-1]) // 4 * 4 - 4, load


def test_bf16_kv_round_trips_through_host_and_storage(tiny_checkpoints):
    """bf16 (what --dtype auto picks on a CPU with bf16 instructions): a starved bf16 device
    pool whose pages go to the host tier and the memory store and come back (the paged decode
    kernel reading them in place) gives the tokens of a large bf16 pool."""
    path = tiny_checkpoints["llama"]
    ref = make_llm(path, dtype="bfloat16", max_total_tokens=8192)
    try:
        expected = multi_turn(ref)[1]
    finally:
        ref.shutdown()
    llm = make_llm(path, dtype="bfloat16", max_total_tokens=160,
                   enable_hierarchical_cache=True, hicache_size=0, hicache_ratio=8.0,
                   hicache_storage_backend="memory",
                   hicache_storage_prefetch_policy="wait_complete",
                   hicache_storage_backend_extra_config='{"prefetch_threshold": 8}')
    try:
        assert str(llm.engine.runner.dtype) == "torch.bfloat16"
        assert llm.engine.runner.plan.dtype == "bfloat16"
        assert multi_turn(llm)[1] == expected
        assert_host_tier_served(llm)
        assert llm.engine.finish_storage_backups(timeout=30) and llm.flush_cache()
        assert multi_turn(llm)[1] == expected
        load = llm.get_load()
        assert load["hicache_storage_hit_tokens"] > 0 and load["hicache_storage_errors"] == 0
        llm.check_integrity()
    finally:
        llm.shutdown()
