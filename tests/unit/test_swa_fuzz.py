"""Randomised stateful test of hybrid SWA memory: the scheduler fuzzer's machine
(test_scheduler_fuzz.py: arrivals sharing prefixes, chunked prefill, client aborts,
retraction, priority preemption, speculation, the step bound with a state dump at the drain)
with an SWA pool always on, plus SWA pressure from outside and one more property after every
step:
- every position a live request's next query reads (q - W + 1 .. q - 1) has an SWA slot in
  the runner's SWA req_to_token row equal to the KV manager's map of the page the request
  holds there -- its own page, or a page of its locked tree prefix that its SWA lock covers.
The SWA fake runner reads each window back and compares it with the full pool, so a page
freed or handed on while a window needs it fails too (tests/unit/fake_swa_runner.py).
"""
from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from tests.unit import test_scheduler_fuzz as base

# Window 1 (no earlier token read) to beyond a prompt; SWA pools from below one request's
# window (aborts) to roomy; the main pool from test_scheduler_fuzz's range.
# Small windows half the time: pages leave them early, so tombstones, cut matches and
# healing inserts are common.
swa_configs = base.configs.flatmap(lambda cfg: st.tuples(
    st.one_of(st.integers(1, 8), st.integers(1, 48)), st.integers(4, 160)).map(
        lambda swa: {**cfg, "swa": swa, "state": None}))


class SWAMachine(base.SchedulerMachine):
    @initialize(cfg=swa_configs, first=st.lists(base.arrivals, min_size=1, max_size=6))
    def build(self, cfg, first):
        base.SchedulerMachine.build(self, cfg, first)

    @rule(tombstone=st.booleans())
    def swa_pressure(self, tombstone):
        """Memory pressure on the SWA pool from elsewhere: every SWA page no lock protects
        goes (tombstones, dropped leaves), or every unlocked cached page."""
        tree = self.engine.scheduler.kv.tree
        if tombstone:
            tree.evict_swa(10**9)
        else:
            tree.evict(10**9)

    @invariant()
    def windows_read_live_swa_pages(self):
        if not hasattr(self, "engine"):
            return
        sched = self.engine.scheduler
        kv, P = sched.kv, sched.page_size
        for req in sched.live_requests():
            if not req.row:
                continue
            row = self.runner.swa_rows.get(req.row, {})
            upto = min(req.row_stale_from, req.num_computed_tokens)
            for p in range(max(req.num_computed_tokens - kv.swa.window + 1, 0), upto):
                page = req.pages[p // P]
                want = kv.swa.map[page] * P + p % P
                assert kv.swa.map[page] and row.get(p) == want, (
                    f"{req.rid}: position {p} in its window: runner SWA slot {row.get(p)}, "
                    f"map says {want}\n{self.engine.dump_state()}")
                if p // P < req.num_tree_pages:
                    assert req.swa_lock_from is not None and p >= req.swa_lock_from, (
                        f"{req.rid}: reads tree position {p} outside its SWA lock "
                        f"(from {req.swa_lock_from})")

    def teardown(self):
        super().teardown()
        if hasattr(self, "engine"):
            kv = self.engine.scheduler.kv
            assert kv.tree.protected_swa_pages() == 0, "an SWA lock survived the drain"
            swa = kv.swa.allocator
            assert swa.available_pages() + kv.tree.cached_swa_pages() == swa.num_pages
            event(f"tombstones cached: {any(n.swa_tombstone for n in kv.tree.nodes())}")
            event(f"matches cut by tombstones: {kv.tree.total_cut_tokens > 0}")
            event(f"tombstones healed: {kv.tree.total_healed_pages > 0}")


# Half the scheduler fuzzer's examples (it draws an SWA pool a third of the time too): each
# example here runs more steps under SWA pressure, and `make test` has a 10-minute budget;
# KVSTRATA_FUZZ_EXAMPLES=N soaks both longer.
SWAMachine.TestCase.settings = settings(base.SchedulerMachine.TestCase.settings,
                                        max_examples=max(base.EXAMPLES // 2, 20))
test_swa_state_machine = SWAMachine.TestCase
