"""Soak (KVSTRATA_SOAK=1, ~55 s): the hybrid tier tests over the tiny Falcon-H1 of
test_falcon_h1.py, whose every layer keeps both K/V pages and a state -- HiCache L2 with a
starved device pool (test_hybrid_hicache.py), NGRAM and STANDALONE speculation
(test_hybrid_spec_engine.py), a PD pair over tcp and mooncake with exact byte counters and a
pressured decode that retracts and restores (test_hybrid_pd_engine.py). Greedy tokens equal
transformers' throughout. `make test` runs these tests over the other hybrids and
test_falcon_h1.py over Falcon-H1; nothing here is Falcon-specific code, so this only varies
what those cover."""
from __future__ import annotations

import pytest

from helpers.hybrid_ckpt import HYBRIDS, build_falcon_h1_checkpoint
from tests.correctness import test_hybrid_hicache as hicache
from tests.correctness import test_hybrid_pd_engine as pd
from tests.correctness import test_hybrid_spec_engine as spec
from tests.correctness.test_hybrid_engine import GREEDY, prompts, ref  # noqa: F401 (fixtures)
from tests.correctness.test_hybrid_pd_engine import short_bootstrap  # noqa: F401 (fixture)
from tests.correctness.test_swa_pd_engine import assert_bytes_crossed, run_pair

pytestmark = pytest.mark.soak


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """The Falcon-H1 checkpoint under every hybrid's name (the borrowed tests pick by name)."""
    path = build_falcon_h1_checkpoint(str(tmp_path_factory.mktemp("falcon_h1_tiers")))
    return {arch: path for arch in HYBRIDS}


test_hicache_multi_turn = hicache.test_multi_turn_prefixes_come_back_from_the_host_tier
test_ngram = spec.test_ngram_equals_transformers_and_hits_after_it
test_standalone = spec.test_standalone_with_a_bigram_draft
test_pd_pressured_decode = pd.test_pressured_decode_retracts_and_restores_exactly


@pytest.mark.parametrize("page_size,chunk,backend", [(1, 7, "tcp"), (16, 16, "mooncake")])
def test_pd_pair(page_size, chunk, backend, paths, prompts, ref):  # noqa: F811
    """Every prompt page (K/V of all layers) and one state slot a request cross, exactly."""
    prefill, decode, port = pd.pair(paths["qwen3_5"], page_size, chunk, backend)
    try:
        plan = decode.scheduler.config.plan
        outs = run_pair(prefill, decode, prompts, port, params=GREEDY)
        for p, got in zip(prompts, outs):
            assert got == ref("qwen3_5")(p)
        pages = sum(-(-len(p) // page_size) for p in prompts)
        assert_bytes_crossed(prefill, decode, pages * plan.bytes_per_page
                             + len(prompts) * plan.state_bytes_per_slot)
        for eng in (prefill, decode):
            pd.whole(eng)
    finally:
        prefill.shutdown()
        decode.shutdown()
