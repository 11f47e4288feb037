"""--enable-deterministic-inference with the real SmolLM2 at bf16 (what --dtype auto picks on a
CPU with bf16 instructions): a seeded sampled request and a greedy one answer with the same
tokens and logprobs cold, warm (a radix hit), after a restart on a warm L3 file store (the
prefix restored from storage), from a Mooncake Store another engine filled (a soak), and with
NGRAM speculative decoding (greedy equals plain).
The PD pair's case is tests/e2e/test_pd_disagg.py (test_deterministic_pair_*)."""
from __future__ import annotations

import pytest

from kvstrata import LLM

pytestmark = pytest.mark.slow

PROMPT = ("The history of the printing press begins in the fifteenth century, when "
          "craftsmen in Mainz combined movable metal type, oil-based ink and a wooden press. "
          * 8) + "Summarise this in one sentence:"
SEEDED = {"max_new_tokens": 12, "temperature": 0.8, "seed": 11, "logprobs": 0,
          "ignore_eos": True}
GREEDY = {"max_new_tokens": 12, "temperature": 0, "logprobs": 0, "ignore_eos": True}


def answers(llm: LLM) -> list[tuple]:
    outs = llm.generate([PROMPT, PROMPT], sampling_params=[SEEDED, GREEDY])
    return [(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]],
             o["meta_info"]["cached_tokens"]) for o in outs]


def engine(**kw) -> LLM:
    return LLM("smollm2-135m", dtype="bfloat16", enable_deterministic_inference=True,
               max_total_tokens=4096, **kw)


def test_cold_warm_and_l3_restart_answer_alike(tmp_path):
    extra = f'{{"file_path": "{tmp_path}", "prefetch_threshold": 8}}'
    storage = dict(enable_hierarchical_cache=True, hicache_size=0, hicache_ratio=2.0,
                   hicache_storage_backend="file",
                   hicache_storage_prefetch_policy="wait_complete",
                   hicache_storage_backend_extra_config=extra)
    with engine(**storage) as llm:
        cold = answers(llm)   # the second copy of the prompt may hit the first's pages
        llm.flush_cache()
        cold = [answers(llm)[0], cold[1]]
        warm = answers(llm)
        assert all(w[2] > 0 for w in warm), "the warm requests were meant to hit the cache"
        assert llm.engine.finish_storage_backups(timeout=60)
    for (c, w) in zip(cold, warm):
        assert (c[0], c[1]) == (w[0], w[1]), "a radix hit changed the answer"
    with engine(**storage) as llm:  # a restart: fresh device and host pools, the store warm
        restored = answers(llm)
        assert llm.get_load()["hicache_storage_hit_tokens"] > 0
    for (c, r) in zip(cold, restored):
        assert (c[0], c[1]) == (r[0], r[1]), "the L3 restore changed the answer"


@pytest.mark.soak
def test_a_second_engine_restoring_from_mooncake_answers_alike():
    """The L3 tier on a Mooncake Store (a master of the test's own): a second engine serves the
    prompt from the pages the first backed up, bit for bit as the first answered it cold. The
    first stays up throughout: a Mooncake client's contributed memory leaves the store with it.
    A soak (the file store's case above runs in `make test`; the Mooncake read path is
    tests/e2e/test_hicache_storage_server.py's)."""
    import json

    pytest.importorskip("mooncake.store", exc_type=ImportError)
    from kvstrata.kv.storage.mooncake_master import MooncakeMaster
    with MooncakeMaster() as master:
        extra = json.dumps({"master_server_address": master.address, "protocol": "tcp",
                            "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1",
                            "global_segment_size": 256 << 20, "local_buffer_size": 64 << 20,
                            "prefetch_threshold": 8})
        storage = dict(enable_hierarchical_cache=True, hicache_size=0, hicache_ratio=2.0,
                       hicache_mem_layout="page_first", hicache_storage_backend="mooncake",
                       hicache_storage_prefetch_policy="wait_complete",
                       hicache_storage_backend_extra_config=extra)
        with engine(**storage) as first:
            cold = answers(first)
            first.flush_cache()
            cold = [answers(first)[0], cold[1]]
            assert first.engine.finish_storage_backups(timeout=60)
            with engine(**storage) as second:
                restored = answers(second)
                assert second.get_load()["hicache_storage_hit_tokens"] > 0
    for (c, r) in zip(cold, restored):
        assert (c[0], c[1]) == (r[0], r[1]), "the Mooncake restore changed the answer"


# NGRAM's prompt: the passage repeats (drafts found) and the question's answer is not its
# next words (drafts rejected). "Summarise ...": an AVX-512 BF16 CPU's greedy answer copied
# the passage and accepted all 33 drafts, so no rejection was verified there.
NGRAM_PROMPT = PROMPT.removesuffix("Summarise this in one sentence:") + (
    "Question: who combined movable metal type in Mainz? Answer:")


def test_ngram_speculation_equals_plain():
    """40 tokens: verify steps of several drafts, some accepted and some not; each verified
    token's logprob is a decode step's."""
    greedy = {**GREEDY, "max_new_tokens": 40}
    with engine() as llm:
        plain = llm.generate(NGRAM_PROMPT, greedy)
    with engine(speculative_algorithm="NGRAM") as llm:
        spec = llm.generate(NGRAM_PROMPT, greedy)
    meta = spec["meta_info"]
    assert 0 < meta["spec_accept_token_num"] < meta["spec_draft_token_num"], meta
    assert spec["output_ids"] == plain["output_ids"]
    assert ([lp for lp, _ in spec["meta_info"]["output_token_logprobs"]]
            == [lp for lp, _ in plain["meta_info"]["output_token_logprobs"]])
