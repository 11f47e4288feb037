"""Recurrent state across PD, the transfer side: the state pool's tensors registered as a third
page region (transfer/disagg/regions.py STATE; kv/state_pool.py page_buffers: a page per state
slot) by the tcp and mooncake backends. A room's page list holds the main pool's pages, then
the request's one state slot (wire id after the main pages, cache/state_pd.py): the slot lands
in the decode's reserved slot, every layer of both components, and nothing else moves; a model
without K/V (Mamba2) registers the state pool alone and its room moves the slot alone; a
server with state paired with one without, or with another ssm dtype, fails at the
handshake."""
from __future__ import annotations

import pytest
import torch

from kvstrata.cache.state_pd import state_base
from kvstrata.config.kv_plan import KVComponent, KVPlan
from kvstrata.config.state_plan import StateComponent
from kvstrata.kv.device_pool import page_buffers_of
from kvstrata.kv.state_pool import RecurrentStatePool
from kvstrata.protocol.disagg import KVPoll, PDMetadata
from kvstrata.transfer.disagg import tcp
from kvstrata.transfer.disagg.registry import create_manager

from .conftest import BACKENDS, NUM_PAGES, free_port, random_pool, wait_until

SLOTS = {"prefill": 6, "decode": 9}  # the pools differ in size, as on real servers
F, S, W = KVPoll.FAILED, KVPoll.SUCCESS, KVPoll.WAITING_FOR_INPUT


def state_pool(slots: int, seed: int, ssm_dtype: str = "float32") -> RecurrentStatePool:
    comps = (StateComponent("conv", 3, (10, 3), "float32"),
             StateComponent("ssm", 3, (2, 4, 6), ssm_dtype))
    plan = KVPlan(1, 4, 2, 16, "none", (), num_state_slots=slots, state_components=comps)
    pool = RecurrentStatePool(plan, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for t in pool.tensors.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return pool


class Side:
    def __init__(self, backend, role, seed, port, kv=True, state=True, ssm_dtype="float32"):
        self.main = random_pool(seed=seed) if kv else None
        self.state = state_pool(SLOTS[role], seed + 50, ssm_dtype) if state else None
        self.mgr = create_manager(
            backend, role, page_buffers_of(self.main) if kv else [], host="127.0.0.1",
            bootstrap_port=port, num_metadata_slots=4, page_size=1, kv_dtype="float32",
            state_buffers=self.state.page_buffers() if state else ())
        # what the scheduler adds to a slot id (cache/state_pd.py): after the main pages
        self.base = NUM_PAGES + 1 if kv else 0

    def wire(self, slot: int) -> int:
        return self.base + slot


@pytest.fixture
def sides(monkeypatch):
    made = []

    def make(backend, prefill=None, decode=None):
        if backend.startswith("tcp"):
            monkeypatch.setattr(tcp, "SLICE_MIN_BYTES",
                                0 if backend == "tcp-slices" else 1 << 40)
        port, name = free_port(), backend.split("-")[0]
        pre = Side(name, "prefill", 2, port, **(prefill or {}))
        made.append(pre)
        dec = Side(name, "decode", 1, 0, **(decode or {}))
        made.append(dec)
        return pre, dec, port

    yield make
    for side in made:
        side.mgr.close()


def room(pre, dec, port, src, dst, number=7):
    sender = pre.mgr.create_sender("127.0.0.1", port, number)
    receiver = dec.mgr.create_receiver("127.0.0.1", port, number)
    wait_until(lambda: receiver.poll() == W, what="receiver WAITING_FOR_INPUT")
    receiver.init(dst, 0)
    wait_until(lambda: sender.poll() in (W, F), what="sender WAITING_FOR_INPUT")
    sender.init(len(src), 0)
    return sender, receiver


def snapshot(side):
    return ([page_buffers_of(side.main)[0].clone()] if side.main is not None else []) + \
        [t.clone() for t in side.state.tensors.values()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv", [True, False], ids=["with-kv", "state-only"])
def test_the_final_state_slot_lands_in_the_reserved_slot(sides, backend, kv):
    pre, dec, port = sides(backend, prefill={"kv": kv}, decode={"kv": kv})
    before = snapshot(dec)
    full_src, full_dst = ([3, 4, 5, 9], [40, 41, 7, 8]) if kv else ([], [])
    src, dst = full_src + [pre.wire(5)], full_dst + [dec.wire(2)]
    sender, receiver = room(pre, dec, port, src, dst)
    if kv:
        sender.send(src[:2], last=False)       # a non-last chunk: main pages only
    sender.send(src[2 if kv else 0:], last=True, metadata=PDMetadata(7, first_token_id=3))
    wait_until(lambda: sender.poll() == S and receiver.poll() == S, what="SUCCESS")
    assert receiver.pages_moved == sender.pages_moved == len(src)
    assert receiver.state_pages_moved == sender.state_pages_moved == 1
    assert receiver.swa_pages_moved == sender.swa_pages_moved == 0
    want = [t.clone() for t in before]
    if kv:
        want[0][:, full_dst] = page_buffers_of(pre.main)[0][:, full_src]
    for w, t in zip(want[1 if kv else 0:], pre.state.tensors.values()):
        w[:, 2] = t[:, 5]                      # every layer of the slot, nothing else
    for got, w in zip(snapshot(dec), want):
        assert torch.equal(got, w)


@pytest.mark.parametrize("decode", [{"state": False}, {"ssm_dtype": "bfloat16"}],
                         ids=["no-state", "other-ssm-dtype"])
def test_mismatched_state_is_refused_at_the_handshake(sides, decode):
    pre, dec, port = sides("tcp-gathered", decode=decode)
    sender, receiver = room(pre, dec, port, [1, pre.wire(1)], [3, 4])
    wait_until(lambda: sender.poll() == F and receiver.poll() == F, what="both FAILED")
    want = ("only the prefill server keeps recurrent (SSM) state" if "state" in decode
            else "--mamba-ssm-dtype")
    assert want in sender.failure_reason and want in receiver.failure_reason


def test_state_slot_zero_and_slots_past_the_pool_are_refused(sides):
    pre, dec, port = sides("tcp-gathered")
    sender, _ = room(pre, dec, port, [1], [3])
    sender.send([pre.wire(0)], last=True)      # the padding slot
    assert sender.poll() == F and "outside the registered pages" in sender.failure_reason
    sender, _ = room(pre, dec, port, [1], [3], number=8)
    sender.send([pre.wire(SLOTS["prefill"] + 1)], last=True)
    assert sender.poll() == F and "outside the registered pages" in sender.failure_reason


def test_wire_ids_follow_the_main_pages():
    """The scheduler's wire ids (cache/state_pd.py) are where the runner's regions put the
    state slots: after the main pool's NUM_PAGES + 1 pages, or first without K/V."""
    pool = state_pool(3, 0)
    kv = (KVComponent("k", 1, (2, 8), "float32"), KVComponent("v", 1, (2, 8), "float32"))
    with_kv = KVPlan(1, NUM_PAGES, 2, 16, "mha", kv, num_state_slots=3,
                     state_components=pool.plan.state_components)
    assert state_base(with_kv) == NUM_PAGES + 1 and state_base(pool.plan) == 0
