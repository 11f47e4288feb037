"""The torch-free PD pair (pd_fake.py) with recurrent state: both runners keep a fake state
pool (fake_state_runner.py: a slot's "state" is the tuple of tokens it consumed, checked at
every forward and against the scheduler's view after every step), the hub moves a room's
final state slot (its wire id after the main pool's pages, cache/state_pd.py) from the
prefill's pool into the decode's, and the backup store keeps BackupOp.state_slot beside the
request's pages (the slot itself forgotten at once: it is free from then on)."""
from __future__ import annotations

from kvstrata.cache.state_pd import state_base
from tests.unit.fake_runner import copy_pages
from tests.unit.fake_state_runner import FakeStateRunner
from tests.unit.pd_fake import FakeTransferHub, PDFakeRunner, PDPair
from tests.unit.pd_fake_backup import FakeBackupStore
from tests.unit.pd_fake_regions import split_at_base


class StateHub(FakeTransferHub):
    def __init__(self, page_size: int, delay: int = 0):
        super().__init__(page_size, delay)
        self.states_moved = 0

    def _copy(self, src_pages: list[int], dst_pages: list[int]) -> int:
        pre, dec = self.runners["prefill"], self.runners["decode"]
        # the state slot crosses last, into a state slot (not a page) of the decode
        pages, slots = split_at_base(src_pages, dst_pages, pre.state_base, dec.state_base)
        assert len(slots) <= 1, f"a room moves one state slot: {src_pages}"
        copy_pages(pre.kv, dec.kv, [s for s, _ in pages], [d for _, d in pages],
                   self.page_size)
        for s, d in slots:
            assert s in pre.states, f"the prefill's state slot {s} holds no state"
            dec.states[d] = pre.states[s]
        self.moved_pages += len(src_pages)
        self.states_moved += len(slots)
        return 0


class StateBackupStore(FakeBackupStore):
    """A decode retraction's backup keeps the request's state slot too (a CPU copy); the
    slot's content is dropped at once, so a restore from the wrong backup, into the wrong
    slot, or a backup of the wrong slot changes what the next forward finds."""

    def __init__(self, runner):
        super().__init__(runner)
        self.states: dict[str, tuple] = {}

    def apply(self, op) -> None:
        r = self.runner
        if op.kind == "backup":
            assert op.state_slot, f"a backup without the request's state slot: {op}"
            assert op.rid not in self.states, f"two state backups {op}"
            self.states[op.rid] = r.states.pop(op.state_slot)
        elif op.kind == "restore":
            assert op.state_slot, f"a restore without a state slot: {op}"
            r.states[op.state_slot] = self.states.pop(op.rid)
        elif op.kind == "discard":
            self.states.pop(op.rid, None)
        super().apply(op)


class PDStateFakeRunner(PDFakeRunner, FakeStateRunner):
    def __init__(self, hub, side, **kw):
        super().__init__(hub, side, **kw)
        self.backups = StateBackupStore(self)
        self.state_base = 0  # set by state_pair once the plan is known


def state_pair(page_size, prefill_pages, decode_pages, prefill_slots, decode_slots,
               prefill_cfg=None, decode_cfg=None, **kw) -> PDPair:
    pair = PDPair(page_size, prefill_pages, decode_pages, hub_cls=StateHub,
                  runner_cls=PDStateFakeRunner,
                  prefill_cfg={"num_state_slots": prefill_slots, **(prefill_cfg or {})},
                  decode_cfg={"num_state_slots": decode_slots, **(decode_cfg or {})}, **kw)
    for engine, runner in ((pair.prefill, pair.prefill_runner),
                           (pair.decode, pair.decode_runner)):
        runner.state_base = state_base(engine.scheduler.config.plan)
    return pair
