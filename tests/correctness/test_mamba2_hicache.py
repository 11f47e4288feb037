"""HiCache L2 and L3 for a model without attention layers (Mamba2ForCausalLM): its pages are
addresses only (KVPlan.pages_hold_kv False), so the host tier keeps ids and state snapshots,
and storage keeps state records alone (cache/state_hiradix.py, transfer/storage_jobs.py).

L2: a tiny Mamba2 (tests/helpers/hybrid_ckpt.py) with a device state pool that holds one
running request's slots only; three chats, three turns each, in round robin, so each chat's
snapshots are evicted to host state slots before its next turn, which loads one back.
L3: an engine answers two prompts and is shut down (its state records drained to the file
store); a second one with fresh pools over the same directory resumes the follow-up turns at
the stored states alone. Greedy tokens must equal transformers' (float32) everywhere; every
pool and slot store is whole after each drain (every invariant after every step:
KVSTRATA_CHECK_INTEGRITY, tests/conftest.py).
"""
from __future__ import annotations

import os

import pytest
import torch

from helpers.hybrid_ckpt import VOCAB, HFGreedy, hybrid_checkpoints
from kvstrata import LLM
from tests.correctness.test_hybrid_hicache import whole
from tests.correctness.test_hybrid_storage import restart

NEW = 6
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return hybrid_checkpoints(str(tmp_path_factory.mktemp("mamba2_hicache")), ["mamba2"])


@pytest.fixture(scope="module")
def refs(paths) -> dict[str, HFGreedy]:
    return {"mamba2": HFGreedy(paths["mamba2"])}


@pytest.mark.parametrize("page_size,write_policy", [(1, "write_through"), (16, "write_back")])
def test_a_starved_state_pool_resumes_chats_from_host_snapshots(page_size, write_policy,
                                                                 paths, refs):
    """A state pool of one running request's slots (3 no_buffer at page size 1, 4
    extra_buffer at 16): each new turn evicts the others' snapshots to the host (write_back
    too: a state eviction writes the node's page ids with it), and the next turn of a chat
    loads its snapshot back (states_from_host), resuming after its previous prompt."""
    per_request = 3 if page_size == 1 else 4
    llm = LLM(paths["mamba2"], skip_tokenizer_init=True, dtype="float32", page_size=page_size,
              max_mamba_cache_size=per_request, enable_hierarchical_cache=True,
              hicache_ratio=2.0, hicache_write_policy=write_policy)
    try:
        plan = llm.server_info()["kv_plan"]
        assert plan["pool_kind"] == "none" and plan["pages_hold_kv"] is False, plan
        assert plan["num_host_state_slots"] == 2 * per_request and plan["num_rows"] == 1, plan
        assert plan["host_pool_bytes"] == (2 * per_request + 1) * plan["state_bytes_per_slot"]
        assert llm.engine.runner.hicache.host_pool is None  # no page bytes on the host
        g = torch.Generator().manual_seed(7)
        chats = [torch.randint(3, VOCAB, (40 + 9 * i,), generator=g).tolist() for i in range(3)]
        hits, before = [], []
        for turn in range(3):
            for c, prompt in enumerate(chats):
                out = llm.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
                whole(llm)
                assert out["output_ids"] == refs["mamba2"](prompt, NEW), f"chat {c} turn {turn}"
                hits.append(out["meta_info"]["cached_tokens"])
                before.append(len(prompt))
                chats[c] = prompt + out["output_ids"] + [7 + turn, 9 + c, 11]
        load = llm.engine.get_load()
        assert load["hicache_states_to_host"] > 0 and load["hicache_states_from_host"] > 0, (
            load, hits)
        # every later turn resumed past its chat's previous prompt (a page-aligned snapshot
        # at 16: the finish or the last track point)
        assert all(h >= (b - page_size) // page_size * page_size
                   for h, b in zip(hits[3:], before)), (hits, before)
    finally:
        llm.shutdown()


def test_restart_on_a_warm_file_store_resumes_at_stored_states(paths, refs, tmp_path):
    load = restart(paths, refs, "mamba2", 1, {"file_path": str(tmp_path)})
    assert load["hicache_storage_state_hits"] == 2, load
    names = os.listdir(tmp_path)  # state records only: pages without K/V store nothing
    assert len(names) == 1 and "-state-" in names[0], names
