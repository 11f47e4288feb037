"""HiCache L2 for a hybrid recurrent model end to end (cache/state_hiradix.py, the HiCache
executor's host state store): a tiny Qwen3.5 (Gated DeltaNet) and a tiny Nemotron-H (Mamba2
layers) from tests/helpers/hybrid_ckpt.py with a starved device K/V pool and few state
slots, --enable-hierarchical-cache on. Interleaved multi-turn chats push each other's
prefixes (pages and snapshots) to the host tier; their next turns hit them there: the pages
are loaded back and the snapshot copied into the request's state slot. Greedy tokens must
equal transformers' (float32); the device pool, the host pool, the state
slots and the host state slots are whole after each drain (free + held + cached == total),
and every invariant is checked after every step (KVSTRATA_CHECK_INTEGRITY, tests/conftest.py).
"""
from __future__ import annotations

import pytest
import torch

from helpers.hybrid_ckpt import VOCAB, HFGreedy, hybrid_checkpoints
from kvstrata import LLM

NEW = 6
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return hybrid_checkpoints(str(tmp_path_factory.mktemp("hybrid_hicache")),
                              ["qwen3_5", "nemotron_h"])


def whole(llm: LLM) -> None:
    sched = llm.engine.scheduler
    assert not sched.live_requests() and not sched.waiting
    llm.check_integrity()  # device + host pages, device + host state slots
    kv = sched.kv
    states, tree = kv.states, kv.tree
    assert states.allocator.available_pages() + tree.cached_states() == states.num_slots
    assert tree.host_slots.available_pages() + tree.cached_host_states() == \
        tree.host_slots.num_pages
    assert tree.pinned_states() == 0  # (pages may stay locked by host writes in flight)


# tp 2 (soak, ~15 s): each rank's device and host state slots hold its heads' share
# (runner/parallel/tp_hybrid.py); the scheduler's host tree is rank 0's, every rank copies.
@pytest.mark.parametrize("arch,page_size,write_policy,tp", [
    ("qwen3_5", 1, "write_through", 1), ("nemotron_h", 16, "write_back", 1),
    pytest.param("qwen3_5", 1, "write_through", 2, marks=pytest.mark.soak)])
def test_multi_turn_prefixes_come_back_from_the_host_tier(arch, page_size, write_policy, tp,
                                                          paths):
    """Three chats, three turns each, one request at a time in round robin: a 128-token
    device pool holds about one chat, so the others' prefixes and snapshots are demoted to
    the host before their next turn, which loads both back (cached_tokens: the hit)."""
    ref = HFGreedy(paths[arch])
    llm = LLM(paths[arch], tp_size=tp, skip_tokenizer_init=True, dtype="float32",
              page_size=page_size,
              max_total_tokens=128, max_mamba_cache_size=12, enable_hierarchical_cache=True,
              hicache_ratio=8.0, hicache_write_policy=write_policy)
    try:
        plan = llm.server_info()["kv_plan"]
        assert plan["num_host_state_slots"] == 8 * 12
        g = torch.Generator().manual_seed(5)
        chats = [torch.randint(3, VOCAB, (40 + 9 * i,), generator=g).tolist() for i in range(3)]
        hits = []
        for turn in range(3):
            for c, prompt in enumerate(chats):
                out = llm.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
                whole(llm)
                assert out["output_ids"] == ref(prompt, NEW), f"chat {c} turn {turn}"
                hits.append(out["meta_info"]["cached_tokens"])
                chats[c] = prompt + out["output_ids"] + [7 + turn, 9 + c, 11]
        load = llm.engine.get_load()
        assert load["hicache_states_to_host"] > 0 and load["hicache_states_from_host"] > 0, (
            load, hits)
        assert load["hicache_host_hit_tokens"] > 0 and load["hicache_demoted_pages"] > 0, load
        assert load["hicache_host_state_slots"] == 8 * 12
        # every later turn resumed at its previous turn's snapshot (from either tier)
        assert all(h >= 40 // page_size * page_size for h in hits[3:]), hits
        assert llm.engine.runner.hicache.host_states is not None
    finally:
        llm.shutdown()
