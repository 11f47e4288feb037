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
        load = llm.get_load()
        assert load["hicache_host_hit_tokens"] > 0, load
        assert load["hicache_demoted_pages"] > 0 and load["hicache_h2d_pages"] > 0, load
        llm.check_integrity()
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
