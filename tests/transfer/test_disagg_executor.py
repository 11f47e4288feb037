"""DisaggExecutor: PDOps applied by room, only state changes reported (FAILED with its
reason, decode SUCCESS with the prefill's metadata), warm-up rooms on the fake backend,
and page_buffers_of sharing the device pool's memory."""
from __future__ import annotations

import torch

from kvstrata.kv.device_pool import page_buffers_of
from kvstrata.protocol.disagg import FAKE_BOOTSTRAP_HOST, KVPoll, PDEvent, PDMetadata, PDOp
from kvstrata.runner.executors.disagg import DisaggExecutor
from kvstrata.transfer.disagg.fake import FakeManager

from .conftest import random_pool, wait_until

B, W, T, S, F = (KVPoll.BOOTSTRAPPING, KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING,
                 KVPoll.SUCCESS, KVPoll.FAILED)


def drain(ex: DisaggExecutor, until, timeout: float = 10.0) -> list[PDEvent]:
    events: list[PDEvent] = []

    def step():
        events.extend(ex.poll())
        if not until(events):
            ex.wait(0.01)
            return False
        return True
    wait_until(step, timeout)
    return events


def test_page_buffers_share_the_pool_memory():
    pool = random_pool("bfloat16", page_size=4)
    (buf,) = page_buffers_of(pool)
    layers, slots, heads, dim = pool.kv.shape[1:]
    assert buf.shape == (2 * layers, pool.plan.num_pages + 1, 4 * heads * dim * 2)
    buf[layers + 1, 3].zero_()  # section = kv * layers + layer: V of layer 1, page 3
    assert not pool.kv[1, 1, 12:16].any() and pool.kv[1, 1, 16:20].any()


def test_events_are_state_changes(make_pair):
    pair = make_pair("tcp-gathered", "float32", 1)
    pre, dec = DisaggExecutor(pair.prefill), DisaggExecutor(pair.decode)
    port = pair.bootstrap_port
    pre.apply([PDOp(1, "sender_create", "127.0.0.1", port),
               PDOp(2, "sender_create", "127.0.0.1", port)])
    dec.apply([PDOp(1, "receiver_create", "127.0.0.1", port),
               PDOp(2, "receiver_create", "127.0.0.1", port)])
    assert pre.poll() == [PDEvent(1, B), PDEvent(2, B)] and pre.poll() == []
    # both rooms wait on one look-up of the prefill; a poll may catch one already moved
    events = drain(dec, lambda ev: {e.room: e.state for e in ev} == {1: W, 2: W})
    for room in (1, 2):
        assert [e.state for e in events if e.room == room] in ([B, W], [W])
    assert pre.has_live and dec.has_live
    dec.apply([PDOp(1, "receiver_init", page_ids=[5, 7], metadata_index=0),
               PDOp(2, "receiver_init", page_ids=[9], metadata_index=1)])
    assert dec.poll() == [PDEvent(1, T), PDEvent(2, T)]
    assert drain(pre, lambda ev: len(ev) == 2) == [PDEvent(1, W), PDEvent(2, W)]
    meta = PDMetadata(1, first_token_id=17, cached_tokens=3)
    pre.apply([PDOp(1, "sender_init", num_pages=2, metadata_index=0),
               PDOp(1, "send", page_ids=[3], last=False),
               PDOp(1, "send", page_ids=[4], last=True, metadata=meta),
               PDOp(2, "abort")])
    events = drain(pre, lambda ev: PDEvent(1, S, pages=2) in ev)  # SUCCESS: 2 pages sent
    assert PDEvent(2, F, error="the request ended on this server") in events
    # TRANSFERRING is reported unless the ack came back before the first poll
    assert [e.state for e in events if e.room == 1] in ([T, S], [S])
    events = drain(dec, lambda ev: len(ev) == 2)
    assert sorted(events, key=lambda e: e.room) == [
        PDEvent(1, S, metadata=meta, pages=2),
        PDEvent(2, F, error=f"aborted by the prefill server ({pair.prefill.endpoint}): "
                            "the request ended on this server")]
    assert not dec.has_live
    pre.apply([PDOp(1, "release"), PDOp(2, "release"), PDOp(2, "release"), PDOp(7, "abort")])
    dec.apply([PDOp(1, "release"), PDOp(2, "release")])
    assert pre.poll() == [] and dec.poll() == [] and not pre.has_live
    assert torch.equal(page_buffers_of(pair.decode_pool)[0][:, [5, 7]],
                       page_buffers_of(pair.prefill_pool)[0][:, [3, 4]])


def test_warmup_rooms_use_the_fake_backend(make_pair):
    pair = make_pair("tcp-gathered")
    pre, dec = DisaggExecutor(pair.prefill), DisaggExecutor(pair.decode)
    pre.apply([PDOp(5, "sender_create", FAKE_BOOTSTRAP_HOST, 8998)])
    dec.apply([PDOp(5, "receiver_create", FAKE_BOOTSTRAP_HOST, 8998)])
    assert pre.poll() == [PDEvent(5, W)] and dec.poll() == [PDEvent(5, W)]
    pre.apply([PDOp(5, "sender_init", num_pages=1, metadata_index=0),
               PDOp(5, "send", page_ids=[1], last=False)])
    dec.apply([PDOp(5, "receiver_init", page_ids=[1], metadata_index=0)])
    assert pre.poll() == [PDEvent(5, T)] and dec.poll() == [PDEvent(5, S)]
    pre.apply([PDOp(5, "send", page_ids=[], last=True)])
    assert pre.poll() == [PDEvent(5, S)]
    assert not pair.prefill.senders and not pair.decode.receivers  # nothing reached tcp


def test_fake_manager_alone():
    ex = DisaggExecutor(FakeManager("decode"))
    ex.apply([PDOp(1, "receiver_create", "h", 1), PDOp(2, "receiver_create", "h", 1),
              PDOp(2, "abort")])
    assert ex.poll() == [PDEvent(1, W), PDEvent(2, F, error="the request ended on this server")]
    ex.apply([PDOp(1, "receiver_init", page_ids=[3], metadata_index=0)])
    assert ex.poll() == [PDEvent(1, S)]  # metadata None: a fake transfer carries none
    ex.close()


def test_rate_helper_runs():
    from kvstrata.bench.transfer_rate import measure_transfer_rate
    r = measure_transfer_rate("tcp", num_pages=8, sections=2, page_bytes=256,
                              pages_per_send=3, repeats=1)
    assert r["bytes"] == 8 * 2 * 256 and r["gbps"] > 0 and r["loopback_socket_gbps"] > 0
