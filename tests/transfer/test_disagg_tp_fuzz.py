"""Randomised rooms between tensor-parallel servers of different sizes over the real tcp
transfer managers (rank_map.py: a smaller decode silences prefill ranks, a larger one has a
prefill rank send to several decode ranks). Hypothesis draws the two sizes, how the prompt's
pages are split into send() calls, and at most one abort (which side, which rank, at which
point of the room); every rank then drives the room as its scheduler would.

Properties:
- every sender and receiver of every rank reaches SUCCESS or FAILED within a bound (a hang
  fails with every side's state);
- without an abort every side succeeds and every decode rank holds the prefill's pages;
- with an abort, the aborting side fails with that reason, and so does every side it
  exchanges pages with (a decode rank's source prefill rank, a source's decode ranks) when
  the abort came before the pages moved; a side that fails names the injected abort;
- however the room ended, each prefill rank's pages_moved (its PDEvent's count) equals the
  most pages any of its decode ranks wrote (their pages_moved).
`KVSTRATA_FUZZ_EXAMPLES=N` runs a longer soak.
"""
from __future__ import annotations

import itertools
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.kv.device_pool import page_buffers_of
from kvstrata.protocol.disagg import KVPoll, PDMetadata
from kvstrata.transfer.disagg.rank_map import rank_route
from kvstrata.transfer.disagg.registry import create_manager
from kvstrata.transfer.disagg.rooms import is_final

from .conftest import free_port, random_pool

SIZES = [(2, 1), (1, 2), (3, 2), (2, 3), (2, 2)]  # (prefill, decode) --tp-size
PHASES = ("created", "init", "sent")  # when the abort happens
EXAMPLES = int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "25"))
_rooms = itertools.count(1)


def _mgr(role: str, pool, port: int, rank: int, size: int):
    return create_manager("tcp", role, page_buffers_of(pool), host="127.0.0.1",
                          bootstrap_port=port, num_metadata_slots=4, page_size=1,
                          kv_dtype="float32", tp_rank=rank, tp_size=size, kv_replicated=True)


@pytest.fixture(scope="module")
def servers():
    """Per (prefill, decode) size: the prefill managers (one KV replicated on every rank),
    their bootstrap port, the decode managers and their pools. Built once: each example
    uses new rooms."""
    built, managers = {}, []
    try:
        for p_size, d_size in SIZES:
            port = free_port()
            pool = random_pool(seed=p_size * 10 + d_size)
            pre = [_mgr("prefill", pool, port, r, p_size) for r in range(p_size)]
            dec_pools = [random_pool(seed=100 + r) for r in range(d_size)]
            dec = [_mgr("decode", dec_pools[r], 0, r, d_size) for r in range(d_size)]
            managers += pre + dec
            built[(p_size, d_size)] = (pre, port, pool, dec, dec_pools)
        yield built
    finally:
        for m in managers:
            m.close()


def _wait(objs, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(o.poll() != KVPoll.BOOTSTRAPPING for o in objs):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {[(o.poll(), o.failure_reason) for o in objs]}")
        time.sleep(0.002)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sizes=st.sampled_from(SIZES), pages=st.integers(1, 9), cuts=st.integers(1, 3),
       abort=st.one_of(st.none(), st.tuples(st.sampled_from(["prefill", "decode"]),
                                            st.integers(0, 2), st.sampled_from(PHASES))))
def test_rooms_between_tp_sizes_always_end(servers, sizes, pages, cuts, abort):
    pre, port, src_pool, dec, dec_pools = servers[sizes]
    room = next(_rooms)
    src = list(range(1, pages + 1))
    dst = list(range(20, 20 + pages))
    senders = [m.create_sender("127.0.0.1", port, room) for m in pre]
    receivers = [m.create_receiver("127.0.0.1", port, room) for m in dec]
    side, rank, phase = abort if abort is not None else (None, 0, None)
    victim = None
    if side is not None:
        victim = (senders if side == "prefill" else receivers)[rank % len(pre if side ==
                                                                          "prefill" else dec)]

    def maybe_abort(now: str) -> None:
        if victim is not None and phase == now:
            victim.abort("injected abort")

    maybe_abort("created")
    _wait(receivers, "receivers never resolved the prefill")
    for r in receivers:
        r.init(dst, 0)
    maybe_abort("init")
    # The prefill ranks wait for their destinations (every decode rank of theirs), as the
    # scheduler's bootstrap queue does; a failed room stops waiting.
    _wait(senders, "senders never got their destinations")
    bounds = sorted({0, pages, *(pages * k // cuts for k in range(1, cuts))})
    for s in senders:
        if s.poll() != KVPoll.FAILED:
            s.init(pages, 0)
    for a, b in zip(bounds, bounds[1:]):
        last = b == pages
        for s in senders:
            if not is_final(s.poll()):
                s.send(src[a:b], last=last,
                       metadata=PDMetadata(room, first_token_id=7) if last else None)
        if a == 0:
            maybe_abort("sent")
    deadline = time.monotonic() + 10
    everyone = senders + receivers
    while not all(is_final(o.poll()) for o in everyone):
        assert time.monotonic() < deadline, [(type(o).__name__, o.poll(), o.failure_reason)
                                             for o in everyone]
        time.sleep(0.002)
    # Pages moved: each prefill rank reports what its decode ranks wrote (the most of them,
    # as each got the same pages), however the room ended.
    routes = [rank_route(d, sizes[1], sizes[0], True) for d in range(sizes[1])]
    for p, s in enumerate(senders):
        wrote = [receivers[d].pages_moved for d, route in enumerate(routes) if route.source == p]
        assert s.pages_moved == max(wrote, default=0), (sizes, p, s.pages_moved, wrote, abort)

    if victim is None:
        assert all(o.poll() == KVPoll.SUCCESS for o in everyone), [
            o.failure_reason for o in everyone]
        want = page_buffers_of(src_pool)[0][:, src]
        for r, pool in enumerate(dec_pools):
            assert torch.equal(page_buffers_of(pool)[0][:, dst], want), r
        return
    if victim.poll() == KVPoll.SUCCESS:  # it ended before the abort (no-op on an ended room)
        assert phase == "sent"
        return
    assert "injected abort" in victim.failure_reason
    p_size, d_size = sizes
    routes = [rank_route(d, d_size, p_size, True) for d in range(d_size)]
    # The sides it exchanges pages with fail too, unless the abort came after the first
    # send (the room may have ended there already). A silent prefill rank ends its half
    # when the prompt is computed: an abort between it and its decode rank may arrive after
    # that end either way (as any abort racing the last message); the room still fails on
    # the side that carries the pages.
    if side == "decode":
        d = rank % d_size
        bound = [senders[routes[d].source]]
        told = [senders[p] for p in routes[d].silent]
    else:
        p = rank % p_size
        bound = [receivers[d] for d, route in enumerate(routes) if p == route.source]
        told = [receivers[d] for d, route in enumerate(routes) if p in route.silent]
    for peer in bound + told:
        if phase != "sent" and peer in bound:
            assert peer.poll() == KVPoll.FAILED, (side, rank, phase)
        if peer.poll() == KVPoll.FAILED:
            assert "injected abort" in peer.failure_reason, peer.failure_reason
