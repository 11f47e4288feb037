"""PD transfer under tensor parallelism, in-process: two prefill ranks register in rank 0's
bootstrap server (503 until both have), decode rank r pulls from prefill rank r and gets
that rank's pages; a decode of another tensor-parallel size is refused naming it, and the
prefill's half of the room fails at once (not at its timeout)."""
from __future__ import annotations

import httpx
import torch

from kvstrata.protocol.disagg import KVPoll, PDMetadata
from kvstrata.runner.disagg_executor import page_buffers_of
from kvstrata.transfer.disagg.registry import create_manager

from .conftest import free_port, random_pool, wait_until

S, F, W = KVPoll.SUCCESS, KVPoll.FAILED, KVPoll.WAITING_FOR_INPUT
MINUS = dict.fromkeys(("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank",
                       "target_pp_rank"), -1)


def manager(role: str, pool, port: int, rank: int, size: int):
    return create_manager("tcp", role, page_buffers_of(pool), host="127.0.0.1",
                          bootstrap_port=port, num_metadata_slots=4, page_size=1,
                          kv_dtype="float32", tp_rank=rank, tp_size=size)


def test_decode_rank_r_pulls_prefill_rank_r_and_other_sizes_are_refused(monkeypatch):
    monkeypatch.setenv("KVSTRATA_DISAGG_WAITING_TIMEOUT", "60")
    port = free_port()
    pre_pools = [random_pool(seed=10 + r) for r in range(2)]
    dec_pools = [random_pool(seed=20 + r) for r in range(2)]
    managers = []
    try:
        managers.append(manager("prefill", pre_pools[0], port, 0, 2))
        route = f"http://127.0.0.1:{port}/route"
        assert httpx.get(route, params=MINUS, timeout=5).status_code == 503  # rank 1 not yet
        managers.append(manager("prefill", pre_pools[1], port, 1, 2))
        assert httpx.get(route, params=MINUS, timeout=5).json()["attn_tp_size"] == 2
        decode = [manager("decode", dec_pools[r], 0, r, 2) for r in range(2)]
        managers += decode
        src, dst = [3, 4, 9], [7, 1, 2]
        pairs = []
        for r in range(2):
            sender = managers[r].create_sender("127.0.0.1", port, 5)
            receiver = decode[r].create_receiver("127.0.0.1", port, 5)
            wait_until(lambda: receiver.poll() == W, what="receiver WAITING_FOR_INPUT")
            receiver.init(dst, 0)
            wait_until(lambda: sender.poll() == W, what="sender WAITING_FOR_INPUT")
            sender.init(len(src), 0)
            sender.send(src, last=True, metadata=PDMetadata(5, first_token_id=42))
            pairs.append((sender, receiver))
        for r, (sender, receiver) in enumerate(pairs):
            wait_until(lambda: sender.poll() == S and receiver.poll() == S, what="SUCCESS")
            got = page_buffers_of(dec_pools[r])[0][:, dst]
            assert torch.equal(got, page_buffers_of(pre_pools[r])[0][:, src]), r

        one = manager("decode", random_pool(seed=30), 0, 0, 1)
        managers.append(one)
        sender = managers[0].create_sender("127.0.0.1", port, 6)
        receiver = one.create_receiver("127.0.0.1", port, 6)
        wait_until(lambda: receiver.poll() == F, what="the tp-1 decode refused")
        assert "different tensor-parallel sizes" in receiver.failure_reason
        assert "prefill --tp-size 2 != decode --tp-size 1" in receiver.failure_reason
        wait_until(lambda: sender.poll() == F, timeout=5, what="the prefill half fails at once")
        assert "tensor-parallel" in sender.failure_reason
    finally:
        for m in reversed(managers):
            m.close()
