"""The pages each side reports for a room (PDEvent.pages, what the servers'
disagg_kv_bytes_sent_total / _received_total add up) are the same number on both sides:
the pages the decode side wrote into the room's reserved pages, the prefill counting what
the decode confirmed -- also when a side aborts while pages are on their way."""
from __future__ import annotations

import threading

import pytest

from kvstrata.protocol.disagg import KVPoll, PDMetadata, PDOp
from kvstrata.runner.executors.disagg import DisaggExecutor

from .conftest import BACKENDS, wait_until
from .test_disagg_executor import drain

W, S, F = KVPoll.WAITING_FOR_INPUT, KVPoll.SUCCESS, KVPoll.FAILED
SRC, DST = [3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16]


def ended(events) -> dict[int, tuple[int, int]]:
    """room -> (terminal state, pages) as the scheduler side counts them."""
    return {e.room: (e.state, e.pages) for e in events if e.state in (S, F)}


def open_room(pair, room: int = 1):
    """Both executors up to the prefill's sender_init; returns them."""
    pre, dec = DisaggExecutor(pair.prefill), DisaggExecutor(pair.decode)
    pre.apply([PDOp(room, "sender_create", "127.0.0.1", pair.bootstrap_port)])
    dec.apply([PDOp(room, "receiver_create", "127.0.0.1", pair.bootstrap_port)])
    drain(dec, lambda ev: any(e.state == W for e in ev))
    dec.apply([PDOp(room, "receiver_init", page_ids=DST, metadata_index=0)])
    drain(pre, lambda ev: any(e.state == W for e in ev))
    pre.apply([PDOp(room, "sender_init", num_pages=len(SRC), metadata_index=0)])
    return pre, dec


def hold_decode_chunks(pair) -> tuple[threading.Event, threading.Event]:
    """The decode's transfer thread stops in its next chunk, before writing it (a busy or
    slow decode server): (arrived, go)."""
    arrived, go = threading.Event(), threading.Event()
    mgr = pair.decode.real  # under the warm-up routing
    write = mgr.write_pages

    def held(r, msg, frames):
        arrived.set()
        assert go.wait(10)
        write(r, msg, frames)
    mgr.write_pages = held
    return arrived, go


def finish(pre, dec, room: int = 1):
    ends = [ended(drain(ex, lambda ev: room in ended(ev))) for ex in (pre, dec)]
    return ends[0][room], ends[1][room]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_abort_with_pages_on_their_way(make_pair, backend):
    """The prefill's request ends (client abort) after its last pages left, before the
    decode acknowledged them: they still land and the decode room succeeds; the prefill
    counts them too, from the decode's answer (it used to report FAILED with 0 pages while
    the decode counted all six: the issue's sent < received)."""
    pair = make_pair(backend)
    pre, dec = open_room(pair)
    arrived, go = hold_decode_chunks(pair)
    pre.apply([PDOp(1, "send", page_ids=SRC, last=True, metadata=PDMetadata(1, 5))])
    assert arrived.wait(10)
    pre.apply([PDOp(1, "abort")])
    go.set()
    (p_state, p_pages), (d_state, d_pages) = finish(pre, dec)
    assert (d_state, d_pages) == (S, len(DST))
    assert p_state == F and p_pages == d_pages


@pytest.mark.parametrize("backend", ["tcp-gathered", "tcp-slices"])
def test_prefill_abort_mid_transfer_counts_what_crossed(make_pair, backend):
    """Two of six pages crossed when the prefill aborts: both rooms fail, both count 2."""
    pair = make_pair(backend)
    pre, dec = open_room(pair)
    pre.apply([PDOp(1, "send", page_ids=SRC[:2], last=False)])
    wait_until(lambda: pair.decode.receivers[1].received == 2, what="first chunk")
    pre.apply([PDOp(1, "abort")])
    assert finish(pre, dec) == ((F, 2), (F, 2))


@pytest.mark.parametrize("backend", ["tcp-gathered", "tcp-slices"])
def test_decode_abort_while_a_chunk_is_written(make_pair, backend):
    """The decode's request ends while its transfer thread handles a chunk: a chunk that
    lands in a room already failed is not counted, on either side."""
    pair = make_pair(backend)
    pre, dec = open_room(pair)
    pre.apply([PDOp(1, "send", page_ids=SRC[:2], last=False)])
    wait_until(lambda: pair.decode.receivers[1].received == 2, what="first chunk")
    arrived, go = hold_decode_chunks(pair)
    pre.apply([PDOp(1, "send", page_ids=SRC[2:], last=True, metadata=PDMetadata(1, 5))])
    assert arrived.wait(10)
    dec.apply([PDOp(1, "abort")])
    go.set()
    assert finish(pre, dec) == ((F, 2), (F, 2))


def test_decode_abort_before_any_page_counts_nothing(make_pair):
    pair = make_pair("tcp-gathered")
    pre, dec = open_room(pair)
    dec.apply([PDOp(1, "abort")])
    assert finish(pre, dec) == ((F, 0), (F, 0))


def test_a_closing_prefill_room_gives_up_on_a_silent_decode(make_pair, monkeypatch):
    """The decode never answers the abort (its transfer thread is stuck): the prefill room
    does not wait forever; it fails with the count confirmed so far, as for a dead peer."""
    monkeypatch.setenv("KVSTRATA_DISAGG_HEARTBEAT_INTERVAL", "0.25")
    pair = make_pair("tcp-gathered")
    pre, dec = open_room(pair)
    arrived, go = hold_decode_chunks(pair)
    try:
        pre.apply([PDOp(1, "send", page_ids=SRC, last=True, metadata=PDMetadata(1, 5))])
        assert arrived.wait(10)
        pre.apply([PDOp(1, "abort")])
        assert ended(drain(pre, lambda ev: 1 in ended(ev), timeout=5))[1] == (F, 0)
    finally:
        go.set()
