"""Randomised stateful test of scheduler + KV manager + radix cache (+ HiCache bookkeeping)
against the fake runner, without torch.

Hypothesis draws an engine (page size, pool down to one request's need, chunk size (also
below a page), radix on/off, HiCache on/off and its write policy, fcfs/lpm/lof, row limit,
speculative decoding on/off with its draft length and a seeded pattern of right and wrong
draft tokens, priority scheduling with preemption on/off, its threshold and direction, a
bounded queue, a hybrid SWA pool (window, SWA pages; the fake runner reads every window
back through swa_slots, tests/unit/fake_swa_runner.py; with HiCache L2 / L3 too, whose host
and storage copies carry the SWA halves), a recurrent state pool (an SSM hybrid: state slots,
snapshot strategy, track interval; no SWA pool then, speculation drafts chains; with HiCache
L2 / L3 its snapshots get host copies and state records: the fake runner checks every state
slot's tokens, host and storage copies included, tests/unit/fake_state_runner.py)) and then
interleaves arrivals (prompts sharing prefixes, drawn priorities),
client aborts and engine steps.
Properties:
- every KV invariant holds after every step (KVSTRATA_CHECK_INTEGRITY, set by conftest);
- every request ends within a step bound; a hang fails with the scheduler's state dump;
- a request that finishes has exactly the tokens it would have alone (the fake runner reads
  its KV back through req_to_token, so a wrong page changes them);
- a request is aborted only by its client, by a full queue (503), or with an out-of-memory error when it cannot fit
  alone (prompt + max_new_tokens - 1 positions, in whole pages, exceed the pool, or the
  prompt leaves no room for one more token);
- after draining, the pools are whole: nothing locked, every page free or cached;
- with HiCache L3, once drained and backed up, every page leaves the device and host tiers
  and each finished request comes back with its answer appended: its prefix comes from
  storage, with the same exact-token and step-bound properties.
`KVSTRATA_FUZZ_EXAMPLES=N` runs a longer soak; failures are kept in hypothesis' example
database (.hypothesis/) and replayed first on the next run.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from kvstrata.cache.hiradix_cache import WRITE_POLICIES
from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.request import EngineRequest
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.engine.sides.priority import EVICTED_MESSAGE, QUEUE_FULL_MESSAGE
from kvstrata.engine.sides.registry import spec_side
from kvstrata.protocol import SamplingParams
from tests.unit import end_counter
from tests.unit.fake_runner import (FakeRunner, FakeStorage, pattern_drafter,
                                    reference_tokens)
from tests.unit.fake_state_runner import FakeStateRunner
from tests.unit.fake_swa_runner import FakeSWARunner

VOCAB = 211
MAX_REQUESTS = 10
# 200 in `make test` (its 10-minute budget; depth comes from the soaks in docs/testing.md,
# e.g. 1500 examples on 2026-12-07); KVSTRATA_FUZZ_EXAMPLES=N for depth.
EXAMPLES = int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "200"))
# Shared prefixes: prompts start with a slice of one of these, so the radix tree gets hits,
# splits and duplicate inserts.
BASES = [[(b * 37 + i * 11 + 5) % VOCAB for i in range(64)] for b in range(3)]

configs = st.fixed_dictionaries({
    "page_size": st.sampled_from([1, 2, 4, 16]),
    "pool_tokens": st.integers(16, 112),
    "chunk": st.one_of(st.none(), st.integers(1, 24), st.integers(1, 24)),
    "disable_radix_cache": st.booleans(),
    "hicache_pages": st.sampled_from([0, 0, 4, 40, 120]),
    "write_policy": st.sampled_from(WRITE_POLICIES),
    "schedule_policy": st.sampled_from(["fcfs", "lpm", "lof"]),
    # Priority scheduling: (preemption on, threshold, low values first), or off; a bounded
    # waiting queue (--max-queued-requests) or none.
    "priority": st.one_of(st.none(), st.tuples(st.booleans(), st.sampled_from([0, 1, 3, 10]),
                                               st.booleans())),
    "max_queued": st.sampled_from([None, None, None, 1, 3]),
    # Speculation: (num_draft_tokens, seed of the right/wrong draft pattern, algorithm), or
    # off. NGRAM: the side's drafts replaced by the pattern; STANDALONE: the side leaves
    # RUNNER_DRAFT placeholders that the fake runner fills with the pattern.
    "spec": st.one_of(st.none(), st.tuples(st.integers(2, 6), st.integers(0, 2**16),
                                           st.sampled_from(["NGRAM", "STANDALONE", "EAGLE"]))),
    "max_running_requests": st.sampled_from([1, 2, 4, 64]),
    "conservativeness": st.sampled_from([0.05, 0.05, 0.3, 1.0]),
    # HiCache L3 (with a host pool): job latency in steps, injected backend errors and
    # corrupt reads (0 = none), prefetch policy (timeouts counted in steps).
    "storage": st.one_of(st.none(), st.tuples(st.integers(1, 3), st.sampled_from([0, 0, 3]),
                                              st.sampled_from([0, 0, 2]),
                                              st.sampled_from(["best_effort", "wait_complete",
                                                               "timeout"]))),
    # Hybrid SWA memory: (window in tokens, SWA pool in tokens), or off.
    "swa": st.one_of(st.none(), st.none(), st.tuples(st.integers(1, 40), st.integers(8, 96))),
    # Recurrent state (an SSM hybrid): (state slots, --mamba-radix-cache-strategy, track
    # interval in pages, HiCache host state slots), or off. Takes the place of the SWA pool
    # (not built beside it); with a host tier (hicache_pages) its snapshots get host copies
    # (cache/state_hiradix.py), and with L3 state records beside the pages
    # (cache/state_storage.py); speculation with it drafts chains (NGRAM /
    # STANDALONE: a verify commits the accepted step's state); no_buffer at pages > 1 runs
    # as auto.
    "state": st.one_of(st.none(), st.none(), st.none(), st.tuples(
        st.integers(1, 24), st.sampled_from(["auto", "no_buffer", "extra_buffer"]),
        st.sampled_from([1, 2, 4]), st.sampled_from([1, 3, 12]))),
    # With a state pool: a model whose layers are all recurrent (Mamba2) when False, its
    # pages without K/V (KVPlan.pages_hold_kv; no STANDALONE draft, which config refuses
    # there): the tree writes a node's page ids to the host with its snapshot at a state
    # eviction under every write policy (cache/state_hiradix.py). The fake runner still
    # models pages' contents.
    "pages_hold_kv": st.booleans(),
})
prompts = st.tuples(st.integers(0, len(BASES) - 1), st.integers(0, 40),
                    st.lists(st.integers(3, VOCAB - 1), max_size=16))
priorities = st.sampled_from([15, -12, 0, 2, None])  # spread: differences beat thresholds


# One arrival: a prompt, max_new_tokens, a priority and a cache salt (SGLang's extra_key /
# cache_salt: the same prompts under another salt share nothing, and the tree, the host
# tier and storage all see salted ids).
arrivals = st.tuples(prompts, st.integers(1, 32), priorities,
                     st.sampled_from([None, None, "a", "b"]))


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(cfg=configs, first=st.lists(arrivals, min_size=1, max_size=6))
    def build(self, cfg, first):
        P = cfg["page_size"]
        state = cfg.get("state")
        if state is not None:
            unbuilt = ("EAGLE",) if cfg["pages_hold_kv"] else ("EAGLE", "STANDALONE")
            spec = cfg["spec"] if cfg["spec"] is None or cfg["spec"][2] not in unbuilt else None
            cfg = {**cfg, "swa": None, "spec": spec}
        swa = cfg["swa"]
        hicache = cfg["hicache_pages"] if not cfg["disable_radix_cache"] else 0
        self.cfg = cfg
        storage = cfg["storage"] if hicache else None
        store = None if storage is None else FakeStorage(delay=storage[0], error_every=storage[1],
                                                         corrupt_every=storage[2])
        l3 = {} if storage is None else {
            "hicache_storage_backend": "memory", "hicache_storage_prefetch_policy": storage[3],
            "hicache_storage_backend_extra_config":
                '{"prefetch_threshold": 1, "prefetch_timeout_base": 2, '
                '"prefetch_timeout_per_ki_token": 0}'}
        priority = {} if cfg["priority"] is None else {
            "enable_priority_scheduling": True, "disable_priority_preemption": not cfg["priority"][0],
            "priority_scheduling_preemption_threshold": cfg["priority"][1],
            "schedule_low_priority_values_first": cfg["priority"][2]}
        swa_plan = {} if swa is None else {"swa_window": swa[0],
                                           "num_swa_pages": max(swa[1] // P, 1)}
        state_plan = {} if state is None else {
            "num_state_slots": state[0], "mamba_track_interval": state[2] * P,
            "num_host_state_slots": state[3] if hicache else 0,
            "pages_hold_kv": cfg["pages_hold_kv"],
            "mamba_radix_cache_strategy": "auto" if state[1] == "no_buffer" and P > 1
            else state[1]}
        self.runner = (FakeStateRunner(page_size=P, vocab_size=VOCAB, storage=store)
                       if state is not None else
                       FakeRunner(page_size=P, vocab_size=VOCAB, storage=store) if swa is None
                       else FakeSWARunner(swa[0], page_size=P, vocab_size=VOCAB, storage=store))
        self.engine = EngineCore(self.runner, SchedulerConfig(
            num_pages=max(cfg["pool_tokens"] // P, 1), page_size=P,
            max_running_requests=cfg["max_running_requests"],
            chunked_prefill_size=cfg["chunk"],
            schedule_policy=(cfg["schedule_policy"] if cfg["priority"] is None
                             else {"lpm": "fcfs"}.get(cfg["schedule_policy"],
                                                      cfg["schedule_policy"])),
            max_queued_requests=cfg["max_queued"], **priority,
            schedule_conservativeness=cfg["conservativeness"],
            disable_radix_cache=cfg["disable_radix_cache"],
            num_host_pages=hicache, hicache_write_policy=cfg["write_policy"], **l3, **swa_plan,
            **state_plan,
            **({} if cfg["spec"] is None else {"speculative_algorithm": cfg["spec"][2],
                                               "speculative_num_draft_tokens": cfg["spec"][0]})))
        if cfg["spec"] is not None and cfg["spec"][2] == "NGRAM":
            spec_side(self.engine.scheduler).draft = pattern_drafter(
                *cfg["spec"][:2], VOCAB, trees=state is None)
        elif cfg["spec"] is not None:
            self.runner.draft_rng.seed(cfg["spec"][1])
        self.ends = end_counter.install(self.engine)
        if store is not None:
            self.engine.scheduler.kv.storage.clock = lambda: self.steps  # timeouts in steps
        self.total_tokens = self.engine.scheduler.kv.total_tokens
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.salts: dict[str, str | None] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, object] = {}
        self.client_aborted: set[str] = set()
        self.steps = 0
        self.chunked_steps = 0
        self.arrive(first)

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(batch=st.lists(arrivals, min_size=2, max_size=5))
    def arrive(self, batch):
        for (base, keep, tail), max_new, priority, salt in \
                batch[:MAX_REQUESTS - len(self.requests)]:
            self._add(BASES[base][:keep] + tail or [BASES[base][0]], max_new, priority, salt)

    def _add(self, ids, max_new, priority=None, salt=None):
        rid = f"r{len(self.requests)}"
        self.requests[rid] = (ids, max_new)
        self.salts[rid] = salt
        self.outputs[rid] = []
        self.engine.add_request(EngineRequest(rid, ids, SamplingParams(
            max_new_tokens=max_new, temperature=0, ignore_eos=True), priority=priority,
            cache_salt=salt))

    @rule(n=st.integers(1, 8),
          abort=st.one_of(st.none(), st.none(), st.none(), st.integers(0, MAX_REQUESTS - 1)))
    def step(self, n, abort):
        for _ in range(n):
            self._one_step()
        if abort is not None:
            rid = f"r{abort}"  # unknown or finished: a no-op, as for a late client
            if rid in self.requests and rid not in self.finished:
                self.client_aborted.add(rid)
            self.engine.abort_request(rid)

    def _one_step(self):
        self.steps += 1
        self.chunked_steps += self.engine.scheduler.chunked_req is not None
        for out in self.engine.step():  # KVSTRATA_CHECK_INTEGRITY=1: invariants every step
            self.outputs[out.rid] += out.new_token_ids
            if out.finished:
                assert out.rid not in self.finished, f"{out.rid} finished twice"
                self.finished[out.rid] = out.finish_reason

    @precondition(lambda self: self.engine.scheduler.kv.storage is not None)
    @rule()
    def evict_everything(self):
        """Memory pressure from elsewhere: every unpinned page leaves the device and the host
        tier, so later arrivals can only find their prefix in storage."""
        tree = self.engine.scheduler.kv.tree
        tree.evict(10**9)
        tree.evict_host(10**9)

    @invariant()
    def kv_state_is_consistent(self):
        if hasattr(self, "engine"):
            self.engine.check_integrity()

    # ------------------------------------------------------------------ end
    def _drain(self):
        budget = 200 + 30 * sum(len(p) + n for p, n in self.requests.values())
        for _ in range(budget):
            if not self.engine.has_unfinished_requests():
                break
            self._one_step()
        else:
            raise AssertionError(f"not drained after {budget} steps; config {self.cfg}\n"
                                 + self.engine.dump_state())

    def _revisit_from_storage(self):
        """With HiCache L3, after the drain: once the backups ended, every page leaves the
        device and host tiers and each finished request comes back with its answer and one
        more token, so its prefix can come back only from storage (the L3 restore, which
        random arrivals alone almost never reach)."""
        assert self.engine.finish_storage_backups(timeout=5)
        self.evict_everything()
        for rid, reason in list(self.finished.items()):
            if reason.type == "length":
                ids = self.requests[rid][0] + self.outputs[rid] + [VOCAB - 1]
                self._add(ids, 2, salt=self.salts[rid])
        self._drain()

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        self._drain()
        if self.engine.scheduler.kv.storage is not None:
            self._revisit_from_storage()
        assert set(self.finished) == set(self.requests), "a request never ended"
        self.ends.check_drained()  # every ending went through the one path, once
        sched = self.engine.scheduler
        event(f"retractions: {min(sched.num_retractions, 3)}")
        event(f"chunked steps: {min(self.chunked_steps, 3)}")
        event(f"aborts: {sum(r.type == 'abort' for r in self.finished.values())}")
        if self.cfg["priority"] is not None:
            event(f"preempted: {min(self.engine.get_load()['num_preempted_reqs'], 2)}")
        if self.cfg["spec"] is not None:
            event(f"accepted drafts > 0: {self.runner.verified_drafts > 0}")
        if self.cfg["swa"] is not None:
            event(f"SWA window reads > 0: {self.runner.swa_reads > 0}")
        if self.cfg.get("state") is not None:
            event(f"state snapshots copied > 0: {self.runner.copies > 0}")
            event(f"state with speculation: {self.cfg['spec'] is not None}")
            if self.engine.scheduler.kv.hicache:
                tree = self.engine.scheduler.kv.tree
                event(f"host states loaded > 0: {tree.states_from_host > 0}")
                assert tree.host_slots.available_pages() + tree.cached_host_states() == \
                    tree.host_slots.num_pages, "host state slots held after the drain"
            states = self.engine.scheduler.kv.states
            assert self.engine.scheduler.kv.tree.pinned_states() == 0, "a snapshot pin survived"
            assert states.allocator.available_pages() + \
                self.engine.scheduler.kv.tree.cached_states() == states.num_slots, (
                    "state slots held after the drain")
        storage = self.engine.scheduler.kv.storage
        if storage is not None:
            event(f"L3 hit tokens > 0: {storage.stats.hit_tokens > 0}")
            if self.cfg.get("state") is not None:
                event(f"L3 states restored > 0: {storage.stats.state_hits > 0}")
            assert not storage.busy() and storage.occupied_pages == 0
        for rid, (ids, max_new) in self.requests.items():
            self._check_outcome(rid, ids, max_new, self.finished[rid])
        kv = self.engine.scheduler.kv
        self.engine.check_integrity()
        assert kv.tree.protected_pages() == 0, "a lock survived the drain"
        assert kv.allocator.available_pages() + kv.tree.cached_pages() == kv.allocator.num_pages
        sched = self.engine.scheduler
        assert len(sched.free_rows) == sched.num_rows and not sched.live_requests()

    def _check_outcome(self, rid, ids, max_new, reason):
        P = self.cfg["page_size"]
        if reason.type == "length":
            assert self.outputs[rid] == reference_tokens(ids, max_new, VOCAB), rid
            return
        assert reason.type == "abort", (rid, reason)
        if rid in self.client_aborted:
            return
        if reason.message in (QUEUE_FULL_MESSAGE, EVICTED_MESSAGE):
            assert self.cfg["max_queued"] is not None and reason.status_code == 503, reason
            return
        # The pool must hold the prompt plus one token (SGLang's input length check, 400)
        # and every position that gets KV: prompt + max_new - 1, in whole pages.
        need = max(-(-(len(ids) + max_new - 1) // P) * P, len(ids) + 1)
        swa = self.engine.scheduler.kv.swa
        if swa is not None and swa.allocator.num_pages * P < swa.per_request_tokens + P:
            return  # an SWA pool below one request's window (+ a page to compute)
        assert need > self.total_tokens, (
            f"{rid} (prompt {len(ids)}, max_new {max_new}, needs {need} of "
            f"{self.total_tokens} tokens) was aborted though it fits alone: {reason.message}; "
            f"config {self.cfg}")


SchedulerMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=12, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_scheduler_state_machine = SchedulerMachine.TestCase
