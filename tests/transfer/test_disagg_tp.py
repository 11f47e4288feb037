"""PD transfer under tensor parallelism, in-process: two prefill ranks register in rank 0's
bootstrap server (503 until both have), decode rank r pulls from prefill rank r and gets
that rank's pages; a decode of another tensor-parallel size is refused naming it, and the
prefill's half of the room fails at once (not at its timeout)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from kvstrata.kv.device_pool import page_buffers_of
from kvstrata.protocol.disagg import KVPoll, PDMetadata
from kvstrata.transfer.disagg.registry import create_manager

from .conftest import free_port, random_pool, wait_until

S, F, W = KVPoll.SUCCESS, KVPoll.FAILED, KVPoll.WAITING_FOR_INPUT
MINUS = dict.fromkeys(("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank",
                       "target_pp_rank"), -1)


def manager(role: str, pool, port: int, rank: int, size: int):
    """`pool`: a device pool, or (pool, SWA pool) for hybrid SWA memory."""
    pool, swa = pool if isinstance(pool, tuple) else (pool, None)
    return create_manager("tcp", role, page_buffers_of(pool), host="127.0.0.1",
                          bootstrap_port=port, num_metadata_slots=4, page_size=1,
                          kv_dtype="float32", tp_rank=rank, tp_size=size,
                          swa_buffers=page_buffers_of(swa) if swa is not None else ())


def _pools(seed: int, swa: bool):
    """A rank's pools: its main pool, with hybrid SWA memory also its SWA pool (its share of
    the windowed layers' heads: another seed, so a page from the wrong rank shows)."""
    from tests.transfer.test_disagg_swa_region import swa_pool

    main = random_pool(seed=seed)
    return (main, swa_pool(1, seed + 50)) if swa else main


@pytest.mark.parametrize("swa", [False, True])
def test_decode_rank_r_pulls_prefill_rank_r_and_other_sizes_are_refused(monkeypatch, swa):
    """With hybrid SWA memory each rank registers its SWA pool as a second region: decode
    rank r's SWA pages come from prefill rank r's SWA pool too; another size is refused
    with SGLang's message."""
    monkeypatch.setenv("KVSTRATA_DISAGG_WAITING_TIMEOUT", "60")
    port = free_port()
    pre_pools = [_pools(10 + r, swa) for r in range(2)]
    dec_pools = [_pools(20 + r, swa) for r in range(2)]
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
        if swa:  # the last window's SWA pages (wire ids past the main region: swa_pd.py)
            base = page_buffers_of(pre_pools[0][0])[0].shape[1]
            src, dst = src + [base + 5, base + 2], dst + [base + 1, base + 6]
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
            pre, dec = (pre_pools[r], dec_pools[r]) if swa else ((pre_pools[r],),
                                                                  (dec_pools[r],))
            got = page_buffers_of(dec[0])[0][:, dst[:3]]
            assert torch.equal(got, page_buffers_of(pre[0])[0][:, src[:3]]), r
            if swa:
                got = page_buffers_of(dec[1])[0][:, [1, 6]]
                assert torch.equal(got, page_buffers_of(pre[1])[0][:, [5, 2]]), r
                assert receiver.swa_pages_moved == sender.swa_pages_moved == 2

        one = manager("decode", _pools(30, swa), 0, 0, 1)
        managers.append(one)
        sender = managers[0].create_sender("127.0.0.1", port, 6)
        receiver = one.create_receiver("127.0.0.1", port, 6)
        wait_until(lambda: receiver.poll() == F, what="the tp-1 decode refused")
        assert "prefill --tp-size 2 != decode --tp-size 1" in receiver.failure_reason
        assert ("PD state transfer does not support TP-mismatched non-MLA SWA models" if swa
                else "different tensor-parallel sizes") in receiver.failure_reason
        wait_until(lambda: sender.poll() == F, timeout=5, what="the prefill half fails at once")
        assert "--tp-size 1" in sender.failure_reason
    finally:
        for m in reversed(managers):
            m.close()


def test_rank_routes_by_the_tp_ratio():
    """SGLang's mapping by the attention-TP ratio; different sizes only for a KV every rank
    holds whole (MLA)."""
    from kvstrata.transfer.disagg.rank_map import RankRoute, rank_route

    assert rank_route(1, 2, 2, False) == RankRoute(1, 1)
    assert [rank_route(d, 2, 4, True) for d in range(2)] == [RankRoute(0, 1, (2,)),
                                                             RankRoute(1, 1, (3,))]
    assert rank_route(0, 1, 3, True) == RankRoute(0, 1, (1, 2))
    assert [rank_route(d, 4, 2, True) for d in range(4)] == [
        RankRoute(0, 2), RankRoute(1, 2), RankRoute(0, 2), RankRoute(1, 2)]
    assert [rank_route(d, 3, 2, True).fanout for d in range(3)] == [2, 1, 2]
    # every prefill rank hears from exactly its fanout's decode ranks, or from one that
    # silences it
    for p_size, d_size in ((2, 1), (4, 2), (3, 2), (1, 3), (2, 5)):
        routes = [rank_route(d, d_size, p_size, True) for d in range(d_size)]
        for p in range(p_size):
            sources = [r for r in routes if r.source == p]
            silencers = [r for r in routes if p in r.silent]
            assert (len(sources) == sources[0].fanout if sources else len(silencers) == 1), \
                (p_size, d_size, p)
    with pytest.raises(ValueError, match="splits its KV heads"):
        rank_route(0, 1, 2, False)


def _mla_manager(role: str, pool, port: int, rank: int, size: int, backend: str = "tcp"):
    return create_manager(backend, role, page_buffers_of(pool), host="127.0.0.1",
                          bootstrap_port=port, num_metadata_slots=4, page_size=1,
                          kv_dtype="float32", tp_rank=rank, tp_size=size, kv_replicated=True)


def _serve_room(senders, receivers, room: int, src: list[int], dst: list[int]) -> None:
    """Drive one room as the schedulers do: every rank inits and sends the same pages."""
    for receiver in receivers:
        wait_until(lambda: receiver.poll() == W, what="receiver WAITING_FOR_INPUT")
        receiver.init(dst, 0)
    for sender in senders:
        wait_until(lambda: sender.poll() == W, what="sender WAITING_FOR_INPUT")
        sender.init(len(src), 0)
        sender.send(src[:1], last=False)
        sender.send(src[1:], last=True, metadata=PDMetadata(room, first_token_id=42))


@pytest.mark.parametrize("backend", ["tcp", "mooncake"])
def test_a_replicated_kv_crosses_between_different_tp_sizes(monkeypatch, backend):
    """MLA: tp 2 prefill -> tp 1 decode (prefill rank 1 is told it sends nothing; its half
    still ends) and tp 1 prefill -> tp 2 decode (prefill rank 0 sends every page to both
    decode ranks and succeeds only when both acknowledged)."""
    monkeypatch.setenv("KVSTRATA_DISAGG_WAITING_TIMEOUT", "60")
    src, dst = [3, 4, 9, 10], [7, 1, 2, 5]
    managers = []
    try:
        port2, port1 = free_port(), free_port()
        pre2 = [random_pool(seed=40)] * 2   # one KV on every rank
        managers += [_mla_manager("prefill", pre2[r], port2, r, 2, backend) for r in range(2)]
        pre1 = random_pool(seed=41)
        managers.append(_mla_manager("prefill", pre1, port1, 0, 1, backend))
        dec1 = random_pool(seed=42)
        dec2 = [random_pool(seed=43 + r) for r in range(2)]
        decode1 = _mla_manager("decode", dec1, 0, 0, 1, backend)
        decode2 = [_mla_manager("decode", dec2[r], 0, r, 2, backend) for r in range(2)]
        managers += [decode1, *decode2]

        senders = [managers[r].create_sender("127.0.0.1", port2, 8) for r in range(2)]
        receiver = decode1.create_receiver("127.0.0.1", port2, 8)
        _serve_room(senders, [receiver], 8, src, dst)
        wait_until(lambda: all(s.poll() == S for s in senders) and receiver.poll() == S,
                   what="tp 2 -> tp 1 SUCCESS")
        assert receiver.metadata.first_token_id == 42
        assert (senders[0].pages_moved, senders[1].pages_moved) == (len(src), 0)
        assert torch.equal(page_buffers_of(dec1)[0][:, dst], page_buffers_of(pre2[0])[0][:, src])

        sender = managers[2].create_sender("127.0.0.1", port1, 9)
        receivers = [decode2[r].create_receiver("127.0.0.1", port1, 9) for r in range(2)]
        wait_until(lambda: sender.peer is not None, what="the prefill learns a decode rank")
        assert sender.poll() == KVPoll.BOOTSTRAPPING
        _serve_room([sender], receivers, 9, src, dst)
        wait_until(lambda: sender.poll() == S and all(r.poll() == S for r in receivers),
                   what="tp 1 -> tp 2 SUCCESS")
        assert sorted(sender.acked) == sorted(m.endpoint for m in decode2)
        for r in range(2):
            assert torch.equal(page_buffers_of(dec2[r])[0][:, dst],
                               page_buffers_of(pre1)[0][:, src]), r

        # A decode rank's abort reaches the silent prefill rank too.
        senders = [managers[r].create_sender("127.0.0.1", port2, 10) for r in range(2)]
        receiver = decode1.create_receiver("127.0.0.1", port2, 10)
        wait_until(lambda: all(s.peer is not None for s in senders), what="both ranks joined")
        receiver.abort("client went away")
        wait_until(lambda: all(s.poll() == F for s in senders), timeout=5,
                   what="both prefill ranks fail the room")
        assert all("client went away" in s.failure_reason for s in senders)
        # A silent prefill rank's abort fails the decode's room, which tells the source rank.
        senders = [managers[r].create_sender("127.0.0.1", port2, 11) for r in range(2)]
        receiver = decode1.create_receiver("127.0.0.1", port2, 11)
        wait_until(lambda: all(s.peer is not None for s in senders), what="both ranks joined")
        senders[1].abort("rank 1 ran out of pages")
        wait_until(lambda: receiver.poll() == F and senders[0].poll() == F, timeout=5,
                   what="the decode and the source rank fail the room")
        assert "rank 1 ran out of pages" in senders[0].failure_reason
    finally:  # in parallel: a connected mooncake engine takes ~1 s to close
        with ThreadPoolExecutor(len(managers) or 1) as pool:
            list(pool.map(lambda m: m.close(), managers))
