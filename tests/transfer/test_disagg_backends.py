"""tcp and mooncake backends end to end, one process, two managers on 127.0.0.1: bytes land
in exactly the reserved pages, metadata arrives, states follow protocol/disagg.py, and
every failure (abort, geometry, dead peer, timeouts) fails only its own room, with a reason."""
from __future__ import annotations

import random
import time

import pytest
import torch

from kvstrata.kv.device_pool import page_buffers_of
from kvstrata.protocol.disagg import KVPoll, PDMetadata

from .conftest import BACKENDS, NUM_PAGES, wait_until

B, W, T, S, F = (KVPoll.BOOTSTRAPPING, KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING,
                 KVPoll.SUCCESS, KVPoll.FAILED)


def buffer(pool) -> torch.Tensor:
    return page_buffers_of(pool)[0]


def start_room(pair, room: int, src: list[int], dst: list[int], slot: int = 0,
               prefix_pages: int = 0):
    """Both sides up to the first send: returns (sender, receiver)."""
    sender = pair.prefill.create_sender("127.0.0.1", pair.bootstrap_port, room)
    assert sender.poll() == B  # nothing can have arrived from the decode side yet
    receiver = pair.decode.create_receiver("127.0.0.1", pair.bootstrap_port, room)
    wait_until(lambda: receiver.poll() == W, what="receiver WAITING_FOR_INPUT")
    receiver.init(dst, slot, prefix_pages)
    assert receiver.poll() == T
    wait_until(lambda: sender.poll() == W, what="sender WAITING_FOR_INPUT")
    sender.init(len(src), slot)
    return sender, receiver


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,page_size", [("float32", 1), ("bfloat16", 16)])
def test_pages_land_in_the_reserved_pages(make_pair, backend, dtype, page_size):
    pair = make_pair(backend, dtype, page_size)
    rng = random.Random(7)
    before = buffer(pair.decode_pool).clone()
    # three rooms at once; destination pages random (non-contiguous), source pages with
    # some contiguous runs (so runs get merged on the way)
    dst_all = rng.sample(range(1, NUM_PAGES + 1), 30)
    rooms = {}
    for i, room in enumerate((11, 1 << 62, 5)):
        start = rng.randrange(1, NUM_PAGES - 12)
        src = list(range(start, start + 6)) + rng.sample(range(1, NUM_PAGES + 1), 4)
        dst = dst_all[i * 10:(i + 1) * 10]
        rooms[room] = (src, dst, *start_room(pair, room, src, dst, slot=i))
    for room, (src, dst, sender, receiver) in rooms.items():  # interleaved chunks
        sender.send(src[:3], last=False)
        assert sender.poll() == T
    for room, (src, dst, sender, receiver) in rooms.items():
        sender.send(src[3:7], last=False)
        sender.send(src[7:], last=True, metadata=PDMetadata(room, first_token_id=room % 1000,
                                                            first_logprob=-0.5))
    for room, (src, dst, sender, receiver) in rooms.items():
        wait_until(lambda: sender.poll() == S and receiver.poll() == S, what="SUCCESS")
        assert receiver.metadata == PDMetadata(room, room % 1000, -0.5)
        assert sender.failure_reason is None and receiver.failure_reason is None
    got, want = buffer(pair.decode_pool), buffer(pair.prefill_pool)
    expected = before.clone()
    for src, dst, _, _ in rooms.values():
        expected[:, dst] = want[:, src]
    assert torch.equal(got, expected)  # reserved pages written, every other page untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_pages_the_decode_holds_are_not_sent(make_pair, backend):
    """A decode radix cache hit: the receiver holds the prompt's first pages and reserves
    pages for the rest only; the prefill sends every page in prompt order as always, the
    backend ships only the delta (into the reserved pages, nothing else touched), and a
    whole-prompt hit moves nothing but the metadata."""
    pair = make_pair(backend)
    rng = random.Random(3)
    before = buffer(pair.decode_pool).clone()
    src = rng.sample(range(1, NUM_PAGES + 1), 10)
    dst = rng.sample(range(1, NUM_PAGES + 1), 6)  # for src[4:]
    sender, receiver = start_room(pair, 21, src, dst, prefix_pages=4)
    sender.send(src[:3], last=False)   # all held by the decode: nothing goes
    sender.send(src[3:7], last=False)  # one held, three shipped
    sender.send(src[7:], last=True, metadata=PDMetadata(21, first_token_id=9))
    wait_until(lambda: sender.poll() == S and receiver.poll() == S, what="SUCCESS")
    assert receiver.metadata == PDMetadata(21, first_token_id=9)
    expected = before.clone()
    expected[:, dst] = buffer(pair.prefill_pool)[:, src[4:]]
    assert torch.equal(buffer(pair.decode_pool), expected)
    assert sender.sent == receiver.received == 6  # the held pages were not shipped
    assert sender.pages_moved == receiver.pages_moved == 6  # what the PDEvents report

    # the whole prompt held: only the metadata crosses (a page sent would be "beyond the
    # 0 reserved" and fail the room)
    sender, receiver = start_room(pair, 22, src[:5], [], slot=1, prefix_pages=5)
    sender.send(src[:2], last=False)
    sender.send(src[2:5], last=True, metadata=PDMetadata(22, first_token_id=4))
    wait_until(lambda: sender.poll() == S and receiver.poll() == S, what="SUCCESS")
    assert receiver.metadata == PDMetadata(22, first_token_id=4)
    assert sender.sent == receiver.received == 0
    assert sender.pages_moved == receiver.pages_moved == 0

    # the counts must add up: held + reserved == what the prefill will send
    sender, receiver = start_room(pair, 23, src, dst, slot=2, prefix_pages=3)
    wait_until(lambda: sender.poll() == F and receiver.poll() == F)
    assert ("will send 10 pages but the decode server holds 3 and reserved 6"
            in sender.failure_reason)


# The control plane (aborts, heartbeats, timeouts) is the same code for both backends:
# mooncake runs where its data plane differs (pages, geometry, a peer dying mid-transfer).
@pytest.mark.parametrize("backend", ["tcp-gathered", "tcp-slices"])
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_abort_fails_both_sides(make_pair, backend, side):
    pair = make_pair(backend)
    sender, receiver = start_room(pair, 3, [1, 2, 3], [4, 5, 6])
    sender.send([1], last=False)
    other_s, other_r = start_room(pair, 4, [7], [8], slot=1)
    (sender if side == "prefill" else receiver).abort("client went away")
    wait_until(lambda: sender.poll() == F and receiver.poll() == F, what="both FAILED")
    aborted, told = (sender, receiver) if side == "prefill" else (receiver, sender)
    assert aborted.failure_reason == "client went away"
    assert "server (tcp://" in told.failure_reason and "aborted by the" in told.failure_reason
    assert "client went away" in told.failure_reason
    other_s.send([7], last=True, metadata=PDMetadata(4, 1))  # the other room is unharmed
    wait_until(lambda: other_r.poll() == S and other_s.poll() == S, what="other room")


def test_abort_before_the_peer_shows_up(make_pair):
    pair = make_pair("tcp-gathered")
    receiver = pair.decode.create_receiver("127.0.0.1", pair.bootstrap_port, 9)
    wait_until(lambda: receiver.poll() == W)
    receiver.init([1, 2], 0)
    receiver.abort("early")
    sender = pair.prefill.create_sender("127.0.0.1", pair.bootstrap_port, 9)
    wait_until(lambda: sender.poll() == F, what="sender told of the early abort")
    assert "early" in sender.failure_reason


@pytest.mark.parametrize("backend", BACKENDS)
def test_geometry_mismatch_fails_with_reason(make_pair, backend):
    pair = make_pair(backend, decode_head_dim=16)
    sender = pair.prefill.create_sender("127.0.0.1", pair.bootstrap_port, 1)
    receiver = pair.decode.create_receiver("127.0.0.1", pair.bootstrap_port, 1)
    wait_until(lambda: receiver.poll() == W)
    receiver.init([1, 2], 0)
    wait_until(lambda: sender.poll() == F and receiver.poll() == F, what="both FAILED")
    assert "KV geometry mismatch" in sender.failure_reason
    assert "KV geometry mismatch" in receiver.failure_reason


def test_dtype_mismatch_is_found_at_bootstrap(make_pair):
    pair = make_pair("tcp-gathered", dtype="float32", decode_dtype="bfloat16")
    receiver = pair.decode.create_receiver("127.0.0.1", pair.bootstrap_port, 1)
    wait_until(lambda: receiver.poll() == F)
    assert "kv dtype" in receiver.failure_reason


def test_page_count_and_range_errors(make_pair):
    pair = make_pair("tcp-gathered")
    sender, receiver = start_room(pair, 1, [1, 2, 3], [4, 5])  # prefill will send 3, not 2
    wait_until(lambda: sender.poll() == F and receiver.poll() == F)
    assert "will send 3 pages but the decode server reserved 2" in sender.failure_reason
    sender, receiver = start_room(pair, 2, [1], [4])
    sender.send([NUM_PAGES + 1], last=True)
    assert sender.poll() == F and "outside" in sender.failure_reason
    wait_until(lambda: receiver.poll() == F)


@pytest.mark.parametrize("backend", [BACKENDS[0], BACKENDS[2]])
def test_dead_prefill_fails_its_rooms_then_a_new_prefill_works(make_pair, monkeypatch,
                                                               backend):
    monkeypatch.setenv("KVSTRATA_DISAGG_HEARTBEAT_INTERVAL", "0.25")
    monkeypatch.setenv("KVSTRATA_DISAGG_HEARTBEAT_MAX_FAILURE", "2")
    pair = make_pair(backend)
    sender, receiver = start_room(pair, 1, [1, 2, 3, 4], [5, 6, 7, 8])
    sender.send([1, 2], last=False)
    wait_until(lambda: receiver.received == 2, what="first chunk")  # mid-transfer
    pair.prefill.close()
    wait_until(lambda: receiver.poll() == F, timeout=3, what="decode notices the dead prefill")
    assert "did not answer" in receiver.failure_reason
    assert sender.poll() == F and "closed" in sender.failure_reason
    pair.new_prefill(seed=5)
    sender, receiver = start_room(pair, 2, [3, 9], [10, 11])
    sender.send([3, 9], last=True, metadata=PDMetadata(2, 3))
    wait_until(lambda: receiver.poll() == S, what="room on the new prefill")
    assert torch.equal(buffer(pair.decode_pool)[:, [10, 11]],
                       buffer(pair.prefill_pool)[:, [3, 9]])


def test_a_prefill_restarted_while_idle_is_looked_up_again(make_pair, monkeypatch):
    """The decode had no room with the prefill when it restarted on the same bootstrap
    port (so no heartbeat noticed): the next room looks the route up again -- the prefill
    went quiet -- and reaches the new data endpoint on the first try."""
    monkeypatch.setenv("KVSTRATA_DISAGG_HEARTBEAT_INTERVAL", "0.1")
    pair = make_pair("tcp-gathered")
    sender, receiver = start_room(pair, 1, [1, 2], [5, 6])
    sender.send([1, 2], last=True, metadata=PDMetadata(1, 3))
    wait_until(lambda: receiver.poll() == S, what="a room on the first prefill")
    old = pair.prefill.endpoint
    pair.prefill.close()
    time.sleep(0.3)  # quiet for over two heartbeat intervals
    pair.new_prefill(seed=5, port=pair.bootstrap_port)
    assert pair.prefill.endpoint != old
    sender, receiver = start_room(pair, 2, [3, 9], [10, 11])
    assert receiver.peer == pair.prefill.endpoint
    sender.send([3, 9], last=True, metadata=PDMetadata(2, 3))
    wait_until(lambda: receiver.poll() == S, what="a room on the restarted prefill")


def test_dead_decode_fails_the_prefill_room(make_pair, monkeypatch):
    monkeypatch.setenv("KVSTRATA_DISAGG_HEARTBEAT_INTERVAL", "0.25")
    monkeypatch.setenv("KVSTRATA_DISAGG_HEARTBEAT_MAX_FAILURE", "2")
    pair = make_pair("tcp-gathered")
    sender, receiver = start_room(pair, 1, [1, 2], [5, 6])
    pair.decode.close()
    wait_until(lambda: sender.poll() == F, timeout=3, what="prefill notices the dead decode")
    assert "silent" in sender.failure_reason


def test_timeouts(make_pair, monkeypatch):
    monkeypatch.setenv("KVSTRATA_DISAGG_BOOTSTRAP_TIMEOUT", "1.0")  # room 3 bootstraps first
    monkeypatch.setenv("KVSTRATA_DISAGG_WAITING_TIMEOUT", "0.3")
    pair = make_pair("tcp-gathered")
    lonely = pair.prefill.create_sender("127.0.0.1", pair.bootstrap_port, 1)  # no decode
    sender, receiver = start_room(pair, 3, [1], [2])  # prefill never sends
    wait_until(lambda: F == lonely.poll() == receiver.poll(), timeout=5)
    assert "bootstrap timeout" in lonely.failure_reason
    assert "waiting timeout" in receiver.failure_reason
    wait_until(lambda: sender.poll() == F)  # told by the decode side


def test_a_refused_bootstrap_port_fails_fast(make_pair, monkeypatch):
    """Nothing listens at the bootstrap address: a definite answer, so the room fails after
    the short unreachable retry (not the 300 s bootstrap timeout), with SGLang's text."""
    from .conftest import free_port
    monkeypatch.setenv("KVSTRATA_DISAGG_UNREACHABLE_TIMEOUT", "0.5")
    pair = make_pair("tcp-gathered")
    start = time.monotonic()
    nowhere = pair.decode.create_receiver("127.0.0.1", free_port(), 2)
    wait_until(lambda: nowhere.poll() == F, timeout=5, what="the room fails")
    assert time.monotonic() - start < 3
    assert "Could not fetch prefill parallel info from bootstrap_addr 127.0.0.1:" in \
        nowhere.failure_reason


def test_a_starting_prefill_is_waited_for(make_pair, monkeypatch):
    """A bootstrap server that comes up within the unreachable window is used."""
    from .conftest import free_port
    monkeypatch.setenv("KVSTRATA_DISAGG_UNREACHABLE_TIMEOUT", "10")
    pair = make_pair("tcp-gathered")
    port = free_port()
    receiver = pair.decode.create_receiver("127.0.0.1", port, 4)
    time.sleep(0.8)
    assert receiver.poll() == B
    pair.new_prefill(port=port)
    wait_until(lambda: receiver.poll() == W, what="receiver WAITING_FOR_INPUT")


def test_a_not_ready_prefill_is_retried_up_to_the_bootstrap_timeout(monkeypatch):
    """503 "not registered yet" is a prefill still starting: retried until the bootstrap
    timeout, not cut short by the unreachable window."""
    from kvstrata.transfer.disagg.bootstrap_client import resolve_prefill_route
    from kvstrata.transfer.disagg.bootstrap_server import BootstrapServer

    from .conftest import free_port
    port = free_port()
    server = BootstrapServer("127.0.0.1", port)
    server.start()
    try:
        start = time.monotonic()
        endpoint, why = resolve_prefill_route(("127.0.0.1", port), 1.5, (1, "float32"),
                                              unreachable_timeout=0.1)
    finally:
        server.stop()
    assert endpoint is None and "not ready within 1.5 s (bootstrap timeout)" in why
    assert time.monotonic() - start >= 1.4


def test_a_decode_that_dies_before_reserving_pages_frees_the_prefill_room(make_pair,
                                                                          monkeypatch):
    """The decode joined the room (found the prefill) but its request still waits in its
    prealloc queue when it dies: the prefill fails the room within the heartbeat bound."""
    monkeypatch.setenv("KVSTRATA_DISAGG_HEARTBEAT_INTERVAL", "0.25")
    monkeypatch.setenv("KVSTRATA_DISAGG_HEARTBEAT_MAX_FAILURE", "2")
    pair = make_pair("tcp-gathered")
    sender = pair.prefill.create_sender("127.0.0.1", pair.bootstrap_port, 1)
    receiver = pair.decode.create_receiver("127.0.0.1", pair.bootstrap_port, 1)
    wait_until(lambda: receiver.poll() == W, what="receiver WAITING_FOR_INPUT")
    wait_until(lambda: sender.peer is not None, what="the prefill learns its decode peer")
    assert sender.poll() == B
    pair.decode.close()
    wait_until(lambda: sender.poll() == F, timeout=3, what="prefill notices the dead decode")
    assert "silent" in sender.failure_reason


def test_malformed_page_data_fails_only_that_room(make_pair):
    import zmq

    from kvstrata.transfer.disagg.messages import ENCODER, Chunk
    pair = make_pair("tcp-gathered")
    sender, receiver = start_room(pair, 1, [1], [2])
    other_s, other_r = start_room(pair, 2, [3], [4], slot=1)
    with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as push:
        push.connect(pair.decode.endpoint)
        for origin in ("tcp://127.0.0.1:1", pair.prefill.endpoint):  # a stranger is ignored
            push.send_multipart([ENCODER.encode(Chunk(1, origin, 0, 1, "gathered")),
                                 b"too short"])
        wait_until(lambda: receiver.poll() == F)
        push.setsockopt(zmq.LINGER, 0)
    assert f"bad page data from {pair.prefill.endpoint}" in receiver.failure_reason
    other_s.send([3], last=True)
    wait_until(lambda: other_r.poll() == S)


def test_a_wildcard_host_advertises_a_dialable_address():
    from kvstrata.transfer.disagg.control import advertised_ip
    assert advertised_ip("127.0.0.1") == "127.0.0.1"
    assert advertised_ip("0.0.0.0") not in ("", "0.0.0.0", "::")


def test_a_taken_bootstrap_port_is_a_clear_error():
    import socket
    import threading

    from kvstrata.transfer.disagg.registry import create_manager

    from .conftest import random_pool
    threads = threading.active_count()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(RuntimeError, match="could not listen"):
            create_manager("tcp", "prefill", page_buffers_of(random_pool()),
                           host="127.0.0.1", bootstrap_port=taken.getsockname()[1],
                           num_metadata_slots=2, page_size=1, kv_dtype="float32")
    assert threading.active_count() <= threads  # (an earlier test's thread may end now)
