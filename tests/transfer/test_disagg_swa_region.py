"""Hybrid SWA memory across PD, the transfer side: the SWA pool's buffers registered as a
second page region (transfer/disagg/regions.py) by the tcp and mooncake backends. One room's
page list holds the main pool's pages, then the last window's SWA pages (wire ids from the
full pool's page count on, cache/swa_pd.py): each lands in its own pool's reserved pages and
nowhere else; a hybrid server paired with a uniform one fails at the handshake, with why."""
from __future__ import annotations

import pytest
import torch

from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv.device_pool import MHATokenToKVPool, page_buffers_of
from kvstrata.protocol.disagg import KVPoll, PDMetadata
from kvstrata.transfer.disagg import tcp
from kvstrata.transfer.disagg.registry import create_manager

from .conftest import BACKENDS, free_port, random_pool, wait_until

NUM_PAGES, NUM_SWA = 48, 12  # main pool pages (+ padding page 0) / SWA pool pages
F, S, W = KVPoll.FAILED, KVPoll.SUCCESS, KVPoll.WAITING_FOR_INPUT


def swa_pool(page_size: int, seed: int) -> MHATokenToKVPool:
    """The windowed layers' pool: fewer pages, another layer count than the main pool's."""
    plan = KVPlan.mha(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32",
                      page_size=page_size, num_pages=NUM_SWA)
    pool = MHATokenToKVPool(plan, "cpu")
    raw = page_buffers_of(pool)[0]
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return pool


class Side:
    def __init__(self, backend, role, page_size, seed, hybrid, port):
        self.main = random_pool("float32", page_size, seed=seed)
        self.swa = swa_pool(page_size, seed + 100) if hybrid else None
        self.mgr = create_manager(
            backend, role, page_buffers_of(self.main), host="127.0.0.1", bootstrap_port=port,
            num_metadata_slots=4, page_size=page_size, kv_dtype="float32",
            swa_buffers=page_buffers_of(self.swa) if hybrid else ())

    def wire(self, swa_page: int) -> int:
        return NUM_PAGES + 1 + swa_page  # cache/swa_pd.py swa_base


@pytest.fixture
def sides(monkeypatch):
    made = []

    def make(backend, page_size=1, prefill_hybrid=True, decode_hybrid=True):
        if backend.startswith("tcp"):
            monkeypatch.setattr(tcp, "SLICE_MIN_BYTES",
                                0 if backend == "tcp-slices" else 1 << 40)
        port = free_port()
        name = backend.split("-")[0]
        pre = Side(name, "prefill", page_size, 2, prefill_hybrid, port)
        made.append(pre)
        dec = Side(name, "decode", page_size, 1, decode_hybrid, 0)
        made.append(dec)
        return pre, dec, port

    yield make
    for side in made:
        side.mgr.close()


def room(pre, dec, port, src, dst, number=7, held=(0, 0)):
    sender = pre.mgr.create_sender("127.0.0.1", port, number)
    receiver = dec.mgr.create_receiver("127.0.0.1", port, number)
    wait_until(lambda: receiver.poll() == W, what="receiver WAITING_FOR_INPUT")
    receiver.init(dst, 0, *held)
    wait_until(lambda: sender.poll() in (W, F), what="sender WAITING_FOR_INPUT")
    sender.init(len(src), 0)
    return sender, receiver


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_full_and_swa_pages_land_in_their_own_pools(sides, backend, page_size):
    pre, dec, port = sides(backend, page_size)
    main_before, swa_before = (page_buffers_of(dec.main)[0].clone(),
                               page_buffers_of(dec.swa)[0].clone())
    full_src, full_dst = [3, 4, 5, 9, 10, 2], [40, 41, 7, 8, 30, 11]
    swa_src, swa_dst = [5, 6, 1], [12, 2, 3]   # the last window: 3 pages
    src = full_src + [pre.wire(p) for p in swa_src]
    dst = full_dst + [dec.wire(p) for p in swa_dst]
    sender, receiver = room(pre, dec, port, src, dst)
    sender.send(src[:4], last=False)           # a non-last chunk: main pages only
    sender.send(src[4:], last=True, metadata=PDMetadata(7, first_token_id=3))
    wait_until(lambda: sender.poll() == S and receiver.poll() == S, what="SUCCESS")
    assert receiver.metadata.first_token_id == 3 and receiver.pages_moved == len(src)
    main, swa = page_buffers_of(dec.main)[0], page_buffers_of(dec.swa)[0]
    want_main, want_swa = main_before.clone(), swa_before.clone()
    want_main[:, full_dst] = page_buffers_of(pre.main)[0][:, full_src]
    want_swa[:, swa_dst] = page_buffers_of(pre.swa)[0][:, swa_src]
    assert torch.equal(main, want_main)       # no SWA page spilled into the main pool
    assert torch.equal(swa, want_swa)         # only the reserved SWA pages written


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_radix_prefix_skips_its_full_and_window_pages(sides, backend):
    """The decode holds the prompt's first 4 pages and, of the last window's 3 SWA pages,
    the 2 inside them (prefix_pages 4, prefix_swa_pages 2): only the rest cross, each into
    its reserved page; both sides count 3 pages moved, 1 of them an SWA page."""
    pre, dec, port = sides(backend, 16)
    main_before, swa_before = (page_buffers_of(dec.main)[0].clone(),
                               page_buffers_of(dec.swa)[0].clone())
    full_src, swa_src = [3, 4, 5, 9, 10, 2], [5, 6, 1]
    src = full_src + [pre.wire(p) for p in swa_src]
    dst = [30, 11] + [dec.wire(4)]
    sender, receiver = room(pre, dec, port, src, dst, held=(4, 2))
    sender.send(src[:3], last=False)           # held pages only: nothing crosses yet
    sender.send(src[3:], last=True, metadata=PDMetadata(7, first_token_id=3))
    wait_until(lambda: sender.poll() == S and receiver.poll() == S, what="SUCCESS")
    assert receiver.pages_moved == sender.pages_moved == 3
    assert receiver.swa_pages_moved == sender.swa_pages_moved == 1
    want_main, want_swa = main_before.clone(), swa_before.clone()
    want_main[:, [30, 11]] = page_buffers_of(pre.main)[0][:, [10, 2]]
    want_swa[:, [4]] = page_buffers_of(pre.swa)[0][:, [1]]
    assert torch.equal(page_buffers_of(dec.main)[0], want_main)
    assert torch.equal(page_buffers_of(dec.swa)[0], want_swa)


@pytest.mark.parametrize("prefill_hybrid", [True, False])
def test_a_hybrid_and_a_uniform_server_are_refused_at_the_handshake(sides, prefill_hybrid):
    pre, dec, port = sides("tcp-gathered", prefill_hybrid=prefill_hybrid,
                           decode_hybrid=not prefill_hybrid)
    sender, receiver = room(pre, dec, port, [1, 2], [3, 4])
    wait_until(lambda: sender.poll() == F and receiver.poll() == F, what="both FAILED")
    for reason in (sender.failure_reason, receiver.failure_reason):
        assert "SWA pool (hybrid SWA memory)" in reason and \
            "--disable-hybrid-swa-memory" in reason
    side = "prefill" if prefill_hybrid else "decode"
    assert f"the {side} server keeps the sliding-window layers" in sender.failure_reason


def test_pages_of_one_region_never_land_in_the_other(sides):
    pre, dec, port = sides("tcp-gathered")
    # the prefill names an SWA page where the decode reserved a main page: a bug on one side
    sender, receiver = room(pre, dec, port, [1, pre.wire(2)], [3, 4])
    sender.send([1, pre.wire(2)], last=True, metadata=PDMetadata(7, first_token_id=1))
    wait_until(lambda: sender.poll() == F and receiver.poll() == F, what="both FAILED")
    assert "disagree on the SWA pages" in sender.failure_reason
    # SWA page 0 (the SWA pool's padding page) and ids past the SWA pool are refused
    sender, receiver = room(pre, dec, port, [1], [3], number=8)
    sender.send([pre.wire(0)], last=True)
    assert sender.poll() == F and "outside the registered pages" in sender.failure_reason
    sender, receiver = room(pre, dec, port, [1], [3], number=9)
    sender.send([pre.wire(NUM_SWA + 1)], last=True)
    assert sender.poll() == F and "outside the registered pages" in sender.failure_reason
