"""PD under tensor parallelism (issue 23): a prefill server and a decode server at
--tp-size 2 each (tcp), behind sglang-router. Every prefill rank registers in the bootstrap
server's port table (SGLang's prefill_port_table[dp][cp][tp][pp]); decode rank r pulls its
KV heads from prefill rank r; a room's state is the minimum over ranks. Outputs equal the
co-located server's. The decode pool holds about a third of a batch: its ranks retract with
KV backups and restore. (A decode of another --tp-size: tests/transfer/test_disagg_tp.py.)"""
from __future__ import annotations

import random

import httpx

import pytest

from tests.e2e.pd_servers import PDServers, assert_no_leak, pd_router, serving

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
