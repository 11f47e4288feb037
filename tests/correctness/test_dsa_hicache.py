"""HiCache L2 with the tiny DSA model: a device pool far smaller than a multi-turn working set
moves MLA latent + indexer-key pages through the host pool in each MLA-capable layout, and
the greedy tokens stay those of a large pool without HiCache (bit-exact round trips), which
match transformers. page_head is refused for MLA by name."""
from __future__ import annotations

import pytest

from helpers.compare import assert_match_transformers
from tests.correctness.test_hicache_engine import assert_host_tier_served, make_llm, multi_turn

MLA_PAIRS = [("layer_first", "kernel"), ("page_first", "kernel"),
             ("page_first_direct", "direct")]


@pytest.fixture(scope="module")
def dsa_reference(tiny_dsa_checkpoint):
    llm = make_llm(tiny_dsa_checkpoint, max_total_tokens=8192)
    try:
        prompts, outputs = multi_turn(llm, conversations=2, turns=4)
    finally:
        llm.shutdown()
    assert_match_transformers(tiny_dsa_checkpoint, prompts, outputs,
                              label="dsa no-hicache vs transformers")
    return outputs


@pytest.mark.parametrize("layout,io", MLA_PAIRS)
def test_starved_dsa_pool_with_hicache_matches(layout, io, tiny_dsa_checkpoint, dsa_reference):
    llm = make_llm(tiny_dsa_checkpoint, max_total_tokens=128, enable_hierarchical_cache=True,
                   hicache_mem_layout=layout, hicache_io_backend=io, hicache_size=0,
                   hicache_ratio=8.0)
    try:
        assert llm.engine.kv_plan.pool_kind == "mla"
        _, outputs = multi_turn(llm, conversations=2, turns=4)
        assert outputs == dsa_reference
        assert_host_tier_served(llm)
    finally:
        llm.shutdown()


def test_page_head_is_refused_for_mla(tiny_dsa_checkpoint):
    with pytest.raises(ValueError, match="page_head is MHA-only"):
        make_llm(tiny_dsa_checkpoint, max_total_tokens=128, enable_hierarchical_cache=True,
                 hicache_mem_layout="page_head", hicache_io_backend="kernel")
