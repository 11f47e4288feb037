"""PD under tensor parallelism (issue 23): a prefill server and a decode server at
--tp-size 2 each (tcp), behind sglang-router. Every prefill rank registers in the bootstrap
server's port table (SGLang's prefill_port_table[dp][cp][tp][pp]); decode rank r pulls its
KV heads from prefill rank r; a room's state is the minimum over ranks. Outputs equal the
co-located server's. The decode pool holds about a third of a batch: its ranks retract with
KV backups and restore. (A decode of another --tp-size: tests/transfer/test_disagg_tp.py.)
A hybrid SWA model's pair at tp 2 (soak): each rank's SWA pool is a page region of its own.
A recurrent hybrid's pair at tp 2 (soak): decode rank r receives prefill rank r's share of
each request's final state (runner/parallel/tp_hybrid.py); and (soak) over mooncake with NEXTN
on both servers and a pressured decode that retracts on every rank."""
from __future__ import annotations

import random

import httpx

import pytest

from tests.e2e.pd_servers import (PDServers, assert_no_leak, pd_router, router_generate,
                                  serving)

NEW = 8
TP2 = ("--tp-size", "2")


def _colocated(server, ids: list[int]) -> list[int]:
    return httpx.post(server.base_url + "/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0}},
        timeout=60).json()["output_ids"]


@pytest.fixture(scope="module")
def tp_pair(tiny_model_path):
    from tests.e2e.test_pd_retraction import DECODE_ARGS

    with serving(PDServers(tiny_model_path, "tcp", *TP2, *DECODE_ARGS,
                           "--disaggregation-decode-retraction-backup", "cpu_tensor",
                           prefill_args=TP2)) as pd:
        yield pd


def test_tp2_prefill_and_tp2_decode_through_the_router(tp_pair, server):
    route = f"http://127.0.0.1:{tp_pair.bootstrap_port}/route"
    minus = {k: -1 for k in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank",
                             "target_pp_rank")}
    info = httpx.get(route, params=minus, timeout=5).json()
    assert info["attn_tp_size"] == 2
    ranks = [httpx.get(route, params={**minus, "prefill_dp_rank": 0, "prefill_cp_rank": 0,
                                      "target_pp_rank": 0, "target_tp_rank": r},
                       timeout=5).json() for r in (0, 1)]
    assert ranks[0]["rank_port"] != ranks[1]["rank_port"]
    rng = random.Random(21)
    with pd_router(tp_pair) as router:
        for n in (5, 23, 61):
            ids = [rng.randrange(100, 40000) for _ in range(n)]
            r = httpx.post(router.base_url + "/generate", json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": NEW,
                                                      "temperature": 0.0}}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == _colocated(server, ids), n
    assert_no_leak(tp_pair.decode)
    assert_no_leak(tp_pair.prefill)


def test_tp2_decode_retraction_backs_up_every_rank(tp_pair, server):
    """A batch of 8 at once into the tp 2 decode pool that holds about a third of it:
    requests are retracted with their KV backed up (cpu_tensor) on every rank and restored;
    every answer is the co-located one (or first differs at a near-tie), both pools whole."""
    from tests.e2e.test_pd_retraction import prompts, reference, run_pressured

    batch = prompts(8)
    refs = [reference(server, ids) for ids in batch]
    run_pressured(tp_pair, batch, refs)
    assert_no_leak(tp_pair.decode)
    assert_no_leak(tp_pair.prefill)


@pytest.fixture(scope="module")
def swa_model_path(tmp_path_factory) -> str:
    """A tiny Qwen2 with sliding windows (layer 0 full attention, the rest window 8): hybrid
    SWA memory, with the tiny llama's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from kvstrata.config.model_source import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path("smollm2-135m"))
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=88,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, sliding_window=8,
                         use_sliding_window=True, max_window_layers=1, initializer_range=0.2,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(7)
    path = str(tmp_path_factory.mktemp("swa_qwen2"))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.soak  # 50-95 s on 2 cores (two tp 2 servers of its own, a pressured batch)
def test_tp2_swa_pair_through_the_router_retracts_on_every_rank(swa_model_path):
    """Hybrid SWA memory at --tp-size 2 on both servers: each rank registers its SWA pool as
    a second page region and decode rank r pulls its share of the full and the last
    window's SWA pages from prefill rank r; a pressured decode retracts with the auto rule's
    host_pool backups (the window's SWA pages in the host pool's SWA half) on every rank.
    Answers are transformers' (near-ties aside), both servers drain whole."""
    from helpers.compare import assert_match_transformers

    from tests.e2e.test_pd_retraction import MAX_NEW, prompts, run_batch

    common = (*TP2, "--dtype", "float32")
    decode = (*common, "--max-total-tokens", "448", "--num-reserved-decode-tokens", "8",
              "--hicache-ratio", "2")
    with serving(PDServers(swa_model_path, "tcp", *decode, prefill_args=common)) as pd:
        info = httpx.get(pd.decode.base_url + "/server_info", timeout=10).json()
        assert info["kv_plan"]["pool_kind"] == "swa" and info["tp_size"] == 2
        assert info["disaggregation_decode_retraction_backup"] == "host_pool"
        batch = prompts(8)
        first = router_generate(pd, batch[0], MAX_NEW, timeout=120)
        results = run_batch(pd, batch)
        outs = [results[i].json()["output_ids"] for i in range(len(batch))]
        assert all(results[i].status_code == 200 for i in results), results
        assert outs[0] == first
        assert_match_transformers(swa_model_path, batch, outs, "tp 2 SWA PD")
        load = httpx.get(pd.decode.base_url + "/get_load", timeout=30).json()
        load = load[0] if isinstance(load, list) else load
        assert load["decode_retractions_total"] > 0 and \
            load["decode_restores_host_pool"] == load["decode_backups_host_pool"] > 0, load
        assert_no_leak(pd.decode)
        assert_no_leak(pd.prefill)


@pytest.mark.soak  # ~60 s on 2 cores: two tp 2 servers of its own
def test_tp2_recurrent_hybrid_pair_through_the_router(tmp_path):
    """Qwen3.5 (Gated DeltaNet) at --tp-size 2 on both servers: each prefill rank streams
    its KV heads' pages and, on the last chunk, its heads' share of the final state slot to
    the decode rank of the same index. Greedy tokens equal transformers'; both servers drain
    whole."""
    import torch

    from helpers.hybrid_ckpt import VOCAB, HFGreedy, build_hybrid_checkpoint

    path = build_hybrid_checkpoint("qwen3_5", str(tmp_path / "qwen3_5"))
    ref = HFGreedy(path)
    g = torch.Generator().manual_seed(4)
    args = (*TP2, "--dtype", "float32", "--skip-tokenizer-init")
    with serving(PDServers(path, "tcp", *args, prefill_args=args)) as pd:
        for n in (5, 29, 40):
            ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
            assert router_generate(pd, ids, NEW, timeout=120) == ref(ids, NEW), n
        assert_no_leak(pd.decode)
        assert_no_leak(pd.prefill)


@pytest.mark.soak  # two tp 2 servers of its own, a pressured batch with drafts
def test_tp2_recurrent_hybrid_mooncake_pair_with_nextn_retracts_on_every_rank(tmp_path):
    """Qwen3.5 with an MTP layer (tests/correctness/test_speculative_mtp_hybrid.py) at
    --tp-size 2 on both servers over mooncake, NEXTN on both: each prefill rank sends its KV
    heads' pages, its share of the MTP layer's K/V pages and of the final state; the decode
    pool holds about a third of the batch, so its ranks retract (cpu_tensor: K/V, draft
    K/V, the state slot's share) and restore. Greedy tokens equal transformers', drafts are
    accepted, both servers drain whole."""
    import torch

    from helpers.hybrid_ckpt import VOCAB, HFGreedy, build_hybrid_checkpoint
    from tests.correctness.test_speculative_mtp_hybrid import add_mtp_layer
    from tests.e2e.test_pd_retraction import MAX_NEW, decode_load, run_batch

    path = add_mtp_layer(build_hybrid_checkpoint("qwen3_5", str(tmp_path / "qwen3_5")))
    ref = HFGreedy(path)
    g = torch.Generator().manual_seed(6)
    batch = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (21, 34, 47, 60, 29)]
    args = (*TP2, "--dtype", "float32", "--skip-tokenizer-init", "--speculative-algorithm",
            "NEXTN", "--speculative-disable-by-batch-size", str(1 << 20))
    decode = (*args, "--max-total-tokens", "160", "--num-reserved-decode-tokens", "1")
    with serving(PDServers(path, "mooncake", *decode, prefill_args=args)) as pd:
        results = run_batch(pd, batch)
        for i, ids in enumerate(batch):
            assert results[i].status_code == 200, results[i].text
            assert results[i].json()["output_ids"] == ref(ids, MAX_NEW), i
        load = decode_load(pd)
        assert load["decode_retractions_total"] > 0, load
        assert load["spec_accepted_tokens"] > load["spec_verify_steps"] > 0, load
        assert_no_leak(pd.decode)
        assert_no_leak(pd.prefill)
