"""ModelRunner applies a step's BackupOps before its forward: a decode request backed up
mid-generation, its pages handed to another request in the same step, then restored into
other pages, generates the same greedy tokens as an uninterrupted run (tiny llama)."""
from __future__ import annotations

import pytest

from kvstrata.config.kv_plan import KVPlan
from kvstrata.protocol.disagg import BackupOp
from kvstrata.protocol.sampling_params import SamplingParams
from kvstrata.protocol.scheduler_output import (NewRequestData, ScheduledRequest,
                                                SchedulerOutput)
from kvstrata.runner.model_runner import ModelRunner

PAGE = 4
PROMPT = [5, 9, 14, 3, 27, 8, 11, 40, 2, 19]  # 10 tokens
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
HOST = {"cpu_tensor": {},
        "host_pool": dict(num_host_pages=8, host_layout="page_first", io_backend="kernel",
                          host_pool_use="retraction"),
        # a decode server with HiCache: host_pool backups go into HiCache's host pool
        "shared": dict(num_host_pages=8, host_layout="page_first", io_backend="kernel",
                       host_pool_use="hicache")}


def slot(pages: list[int], pos: int) -> int:
    return pages[pos // PAGE] * PAGE + pos % PAGE


def step(r: ModelRunner, new=(), scheduled=(), freed=(), backups=()):
    return r.execute(SchedulerOutput(0, False, list(new), list(scheduled), list(freed),
                                     ops=list(backups)))


def prefill(rid: str, row: int, pages: list[int], prompt=PROMPT) -> ScheduledRequest:
    return ScheduledRequest(rid, row, 0, prompt, 0, [slot(pages, p) for p in range(len(prompt))],
                            True)


def decode(rid: str, row: int, pages: list[int], pos: int, token: int,
           restored: bool = False) -> ScheduledRequest:
    """One decode token at `pos`; a restored request's row is written again from 0."""
    start = 0 if restored else pos
    return ScheduledRequest(rid, row, pos, [token], start,
                            [slot(pages, p) for p in range(start, pos + 1)], True)


def generate(r: ModelRunner, rid: str, row: int, pages: list[int], n: int) -> list[int]:
    toks = step(r, [NewRequestData(rid, PROMPT, [], GREEDY)], [prefill(rid, row, pages)]).token_ids
    for i in range(n - 1):
        toks += step(r, scheduled=[decode(rid, row, pages, len(PROMPT) + i, toks[-1])]).token_ids
    return toks


@pytest.mark.parametrize("pool", ["cpu_tensor", "host_pool", "shared"])
def test_backup_and_restore_into_other_pages_keeps_greedy_tokens(tiny_checkpoints, pool):
    backend = "cpu_tensor" if pool == "cpu_tensor" else "host_pool"
    r = ModelRunner(tiny_checkpoints["llama"], dtype="float32", device="cpu")
    d = r.model.dims
    r.allocate_kv(KVPlan.mha(num_layers=d.num_layers, num_kv_heads=d.num_kv_heads,
                             head_dim=d.head_dim, dtype="float32", page_size=PAGE,
                             num_pages=24, num_rows=4, context_len=64, **HOST[pool]))
    assert (r.hicache is not None) == (pool == "shared")  # a retraction pool is not HiCache's
    assert (r.backup is not None) == (pool == "host_pool")  # else built at the first op
    try:
        ref = generate(r, "ref", 1, [2, 3, 9, 5, 6], 8)
        step(r, freed=["ref"])

        pages = [7, 8, 10, 11, 12]
        toks = generate(r, "x", 2, pages, 4)  # KV of 13 tokens; the 4th token is not run yet
        assert toks == ref[:4]
        n_kv = len(PROMPT) + 3
        host = [3, 1, 6, 2] if backend == "host_pool" else []
        backup = BackupOp("backup", "x", backend, n_kv, pages[:4], host)
        # Same step: x's pages go to another request, whose prefill overwrites them.
        other = [10, 7, 11, 8]
        prompt_y = [7] * 13
        step(r, [NewRequestData("y", prompt_y, [], GREEDY)], [prefill("y", 1, other, prompt_y)],
             freed=["x"], backups=[backup])
        assert r.backup.has_backup("x")
        if pool == "shared":
            assert r.backup.host_pool is r.hicache.host_pool
        step(r, freed=["y"])

        new_pages = [13, 5, 20, 17, 15]
        restore = BackupOp("restore", "x", backend, n_kv, new_pages[:4], host)
        out = step(r, [NewRequestData("x", PROMPT, toks, GREEDY)],
                   [decode("x", 3, new_pages, n_kv, toks[-1], restored=True)],
                   backups=[restore])
        toks += out.token_ids
        for pos in range(n_kv + 1, n_kv + 4):
            toks += step(r, scheduled=[decode("x", 3, new_pages, pos, toks[-1])]).token_ids
        assert toks == ref
        stats = r.backup.stats()
        assert stats[f"{backend}_backup_count"] == stats[f"{backend}_restore_count"] == 1
        assert stats["backup_bytes"] == 4 * r.plan.bytes_per_page
        assert stats["held_backups"] == 0
    finally:
        r.shutdown()
    assert r.backup is None
