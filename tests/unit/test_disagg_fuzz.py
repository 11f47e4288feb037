"""Randomised stateful test of a PD pair (prefill EngineCore + decode EngineCore joined by the
fake transfer layer of tests/unit/pd_fake.py), without torch. Same structure as
test_scheduler_fuzz.py.

Hypothesis draws both engines (page size, each pool down to one request's need, chunk size,
prefill radix cache on/off and HiCache host pool, the decode radix cache on/off (with a
HiCache host tier behind it or not), fcfs/lpm, row limits, decode extra slots, reserved decode tokens,
polling interval, transfer delay, decode retraction backup cpu_tensor | host_pool with a
host pool of 1..64 pages, speculation on the decode server with a seeded pattern of right
and wrong draft tokens, hybrid SWA memory on both servers: the last window's SWA pages
cross, the fake model reads every window back through the SWA table; recurrent state on both
servers: each room's final state slot crosses, decode backups keep it, the fake runners check
every slot's tokens) and interleaves
arrivals (shared prefixes; per request an
injected bootstrap or transfer failure, a wrong room in the metadata, a slow transfer, or a
peer death: refused, never answering, dying mid-room),
client aborts on either server, and steps of the pair. Properties:
- every KV invariant holds on both sides after every step (KVSTRATA_CHECK_INTEGRITY);
- every request ends on both servers within a step bound (a hang fails with both dumps);
- a decode request that finishes has exactly the tokens it would have co-located, and the
  prefill server answers the first of them;
- every abort has a cause the test can name (client, injection, a pool too small, the last
  running request out of memory, the retraction host pool exhausted, the peer's abort or
  rejection) and the message that goes with it;
- decode retraction backs up and restores KV (a restored request's tokens stay exact);
- after draining, both pools are whole, every room released on both sides, no slot held;
- after draining, the prefill's disagg_kv_bytes_sent_total equals the decode's
  disagg_kv_bytes_received_total and the bytes of the pages that crossed (aborts, failures
  and peer deaths included: pd_fake.py counts as the real backends do).
`KVSTRATA_FUZZ_EXAMPLES=N` runs a longer soak.
"""
from __future__ import annotations

import functools
import os

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from kvstrata.engine.sides.disagg_retract import EXHAUSTED_MESSAGE, OOM_LAST_MESSAGE
from kvstrata.engine.sides.registry import pd_side, spec_side
from tests.unit import end_counter
from tests.unit.fake_runner import pattern_drafter, reference_tokens
from tests.unit.pd_fake import PDPair
from tests.unit.pd_fake_state import state_pair
from tests.unit.pd_fake_swa import swa_pair

VOCAB = 211
MAX_REQUESTS = 8
SALTS = [None, None, "tenant-a"]
# 200 in `make test` (its 10-minute budget); KVSTRATA_FUZZ_EXAMPLES=N for depth.
EXAMPLES = int(os.environ.get("KVSTRATA_FUZZ_EXAMPLES", "200"))
BASES = [[(b * 37 + i * 11 + 5) % VOCAB for i in range(64)] for b in range(3)]

configs = st.fixed_dictionaries({
    "page_size": st.sampled_from([1, 2, 4, 8]),
    "prefill_tokens": st.integers(16, 112),
    # Often a small decode pool (several requests, little room): decode retraction.
    "decode_tokens": st.one_of(st.integers(16, 112), st.integers(24, 56)),
    "chunk": st.one_of(st.none(), st.integers(1, 24)),
    "disable_radix_cache": st.booleans(),
    # The decode server's radix cache (only the pages past its cached prefix cross).
    "decode_radix": st.booleans(),
    "prefill_host_pages": st.sampled_from([0, 0, 4, 40]),  # HiCache L2 on the prefill server
    "schedule_policy": st.sampled_from(["fcfs", "lpm"]),
    "prefill_rows": st.sampled_from([1, 2, 64]),
    "decode_rows": st.sampled_from([1, 2, 4, 4, 64]),
    "extra_slots": st.sampled_from([None, 0, 1, 3]),
    "reserved": st.sampled_from([0, 0, 4, 16, 512]),
    "interval": st.sampled_from([1, 1, 2, 3]),
    "delay": st.integers(0, 4),
    "backup": st.sampled_from(["cpu_tensor", "host_pool"]),
    "decode_host_pages": st.sampled_from([1, 4, 16, 64]),
    # With the decode radix cache and cpu_tensor backups: a host tier behind the decode tree.
    "decode_hicache": st.booleans(),
    # Speculation on the decode server: (num_draft_tokens, seed of the draft pattern,
    # NGRAM | STANDALONE -- the fake runner fills STANDALONE's placeholders) or off.
    "spec": st.one_of(st.none(), st.tuples(st.integers(2, 6), st.integers(0, 2**16),
                                           st.sampled_from(["NGRAM", "STANDALONE", "EAGLE"]))),
    # Priority scheduling on both servers (their queues admit by priority), or off.
    "priority": st.one_of(st.none(), st.sampled_from([0, 10])),  # preemption threshold
    # Hybrid SWA memory on both servers (pd_fake_swa.py): the window, and the decode SWA
    # pool's pages beyond two requests' worth; None: one uniform pool.
    "swa": st.one_of(st.none(), st.none(), st.tuples(st.integers(1, 12), st.integers(0, 12))),
    # Recurrent state on both servers (pd_fake_state.py): the prefill's and the decode's
    # state slots beyond the least that serves (no SWA pool, decode radix cache, decode host
    # tier or draft trees beside it; cpu_tensor backups; the prefill's host tier keeps host
    # copies of snapshots), or none.
    "state": st.one_of(st.none(), st.none(), st.tuples(st.integers(0, 6), st.integers(0, 6))),
})
# Often short prompts: several requests then share a small decode pool (retraction).
prompts = st.tuples(st.integers(0, len(BASES) - 1), st.one_of(st.integers(0, 40),
                                                              st.integers(0, 6)),
                    st.lists(st.integers(3, VOCAB - 1), max_size=12))
# Peer deaths (pd_fake.py): a refused bootstrap address, a peer that never answers, a peer
# that dies some ticks into the room's life (before or after the decode reserved pages).
PEER_DEATHS = ("refused", "never", "dies")
priorities = st.sampled_from([15, -12, 0, 2, None])
injections = st.sampled_from([None] * 6 + ["bootstrap", "transfer", "corrupt", "slow",
                                            *PEER_DEATHS])


class PDMachine(RuleBasedStateMachine):
    @initialize(cfg=configs, first=st.lists(st.tuples(prompts, st.integers(1, 24), injections,
                                                      priorities),
                                            min_size=1, max_size=5))
    def build(self, cfg, first):
        P = cfg["page_size"]
        if cfg["swa"] is not None:  # what hybrid SWA memory takes under PD (rules/swa.py)
            cfg = {**cfg, "spec": None, "state": None}
        if cfg["state"] is not None:  # what recurrent state takes under PD (rules/recurrent.py)
            chain = cfg["spec"] is not None and cfg["spec"][2] != "EAGLE"
            cfg = {**cfg, "decode_radix": False, "decode_hicache": False,
                   "backup": "cpu_tensor", "spec": cfg["spec"] if chain else None}
        self.cfg = cfg
        priority = {"enable_priority_scheduling": True,
                    "priority_scheduling_preemption_threshold": cfg["priority"],
                    "disable_priority_preemption": cfg["backup"] == "host_pool"} \
            if cfg["priority"] is not None else {}
        make = PDPair
        prefill_pages = max(cfg["prefill_tokens"] // P, 1)
        if cfg["swa"] is not None:
            window, extra = cfg["swa"]
            per_request = -(-(window + 1) // P) + 2  # cache/swa_pages.py per_request_tokens
            make = functools.partial(
                swa_pair, window=window, prefill_swa=max(prefill_pages, 2 * per_request),
                decode_swa=2 * per_request + extra)
            event("hybrid SWA memory")
        if cfg["state"] is not None:  # a working and a snapshot slot at least, one to receive
            make = functools.partial(state_pair, prefill_slots=2 + cfg["state"][0],
                                     decode_slots=1 + cfg["state"][1])
            event("recurrent state")
        self.pair = make(
            page_size=P, prefill_pages=prefill_pages,
            decode_pages=max(cfg["decode_tokens"] // P, 1), vocab=VOCAB, delay=cfg["delay"],
            prefill_cfg={"chunked_prefill_size": cfg["chunk"],
                         "disable_radix_cache": cfg["disable_radix_cache"],
                         "num_host_pages": (0 if cfg["disable_radix_cache"]
                                            else cfg["prefill_host_pages"]),
                         # a prefill's host tier beside a state pool keeps host copies of
                         # snapshots too (cache/state_hiradix.py)
                         **({"num_host_state_slots": 1 + cfg["state"][0]}
                            if cfg["state"] is not None and cfg["prefill_host_pages"]
                            and not cfg["disable_radix_cache"] else {}),
                         "schedule_policy": ("fcfs" if cfg["priority"] is not None
                                             else cfg["schedule_policy"]),
                         **priority,
                         "max_running_requests": cfg["prefill_rows"]},
            decode_cfg={"max_running_requests": cfg["decode_rows"],
                        "disaggregation_decode_extra_slots": cfg["extra_slots"],
                        "num_reserved_decode_tokens": cfg["reserved"],
                        "disaggregation_decode_polling_interval": cfg["interval"], **priority,
                        "disaggregation_decode_enable_radix_cache": cfg["decode_radix"],
                        "disaggregation_decode_retraction_backup": cfg["backup"],
                        "num_host_pages": (cfg["decode_host_pages"]
                                           if cfg["backup"] == "host_pool" or (
                                               cfg["decode_radix"] and cfg["decode_hicache"])
                                           else 0),
                        # a decode host tier: HiCache's pool (host_pool backups share it)
                        "host_pool_use": ("hicache" if cfg["decode_radix"]
                                          and cfg["decode_hicache"] else None),
                        **({} if cfg["spec"] is None else {
                            "speculative_algorithm": cfg["spec"][2],
                            "speculative_num_draft_tokens": cfg["spec"][0]})})
        if cfg["spec"] is not None and cfg["spec"][2] == "NGRAM":
            spec_side(self.pair.decode.scheduler).draft = pattern_drafter(
                *cfg["spec"][:2], VOCAB, trees=cfg["state"] is None)
        elif cfg["spec"] is not None:
            self.pair.decode_runner.draft_rng.seed(cfg["spec"][1])
        self.pair.hub.peer_timeout = 40
        self.ends = {side: end_counter.install(getattr(self.pair, side))
                     for side in ("prefill", "decode")}
        self.requests: dict[str, tuple[list[int], int, str | None]] = {}
        self.client_aborted: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        self.arrive(first)

    @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
    @rule(batch=st.lists(st.tuples(prompts, st.integers(1, 24), injections, priorities),
                         min_size=1, max_size=4))
    def arrive(self, batch):
        for (base, keep, tail), max_new, inject, prio in batch[:MAX_REQUESTS - len(self.requests)]:
            ids = BASES[base][:keep] + tail or [BASES[base][0]]
            rid = f"r{len(self.requests)}"
            room = 5000 + len(self.requests)
            if inject == "slow":
                self.pair.hub.inject[room] = {"delay": 12}
            elif inject == "dies":
                self.pair.hub.inject[room] = {"fail": "dies", "dies_after": (room * 7) % 23}
            elif inject == "corrupt":
                self.pair.hub.inject[room] = {"corrupt": True}
            elif inject is not None:
                self.pair.hub.inject[room] = {"fail": inject}
            self.requests[rid] = (ids, max_new, inject)
            # a cache salt on some (both servers' caches key those prompts apart)
            salt = SALTS[(keep + len(tail)) % len(SALTS)]
            self.pair.submit(rid, ids, max_new, room=room, ignore_eos=True, priority=prio,
                             cache_salt=salt)

    @rule(n=st.integers(1, 8),
          abort=st.one_of(st.none(), st.none(), st.tuples(st.integers(0, MAX_REQUESTS - 1),
                                                          st.sampled_from(["prefill", "decode"]))))
    def step(self, n, abort):
        for _ in range(n):
            self.pair.step()
        if abort is not None:
            rid, side = f"r{abort[0]}", abort[1]
            if rid in self.requests and rid not in self.pair.finished[side]:
                self.client_aborted[side].add(rid)
            self.pair.abort(rid, side)

    @invariant()
    def both_sides_consistent(self):
        if hasattr(self, "pair"):
            self.pair.prefill.check_integrity()
            self.pair.decode.check_integrity()

    # ------------------------------------------------------------------ end
    def teardown(self):
        if not hasattr(self, "pair"):
            return
        pair = self.pair
        budget = 300 + 30 * sum(len(p) + n for p, n, _ in self.requests.values())
        for _ in range(budget):
            if not pair.busy():
                break
            pair.step()
        else:
            raise AssertionError(f"not drained after {budget} steps; config {self.cfg}\n"
                                 + pair.prefill.dump_state() + "\n" + pair.decode.dump_state())
        pair.check_drained()  # the byte counters of both servers included
        ends = [(link.crossed, h.state) for link in pair.hub.links.values()
                 for h in (link.sender, link.receiver) if h is not None]
        event(f"pages crossed in a room that failed: {any(n and s == 0 for n, s in ends)}")
        retraction = pd_side(pair.decode.scheduler).retraction
        event(f"decode retractions ({self.cfg['backup']}): {min(retraction.num_retractions, 3)}")
        if self.cfg["priority"] is not None:
            event(f"decode priority preemptions: {min(retraction.num_preempted, 2)}")
        if retraction.exhausted_aborts:
            event("retraction host pool exhausted")
        if self.cfg["spec"] is not None:
            event(f"decode accepted drafts > 0: {self.pair.decode_runner.verified_drafts > 0}")
        if self.cfg["state"] is not None:
            event(f"state slots crossed > 0: {pair.hub.states_moved > 0}; "
                  f"retracted with state: {retraction.num_retractions > 0}")
            for engine in (pair.prefill, pair.decode):
                states = engine.scheduler.kv.states
                assert states.allocator.available_pages() + \
                    engine.scheduler.kv.tree.cached_states() == states.num_slots, (
                        "state slots held after the drain")
            assert not pair.decode_runner.backups.states, "a state backup outlived its request"
        for side in ("prefill", "decode"):
            assert set(pair.finished[side]) == set(self.requests), f"{side}: a request never ended"
            self.ends[side].check_drained(side)  # one end path, once (KV in flight too)
        for rid, (ids, max_new, inject) in self.requests.items():
            self._check_outcome(rid, ids, max_new, inject)

    def _check_outcome(self, rid, ids, max_new, inject):
        pair = self.pair
        pre, dec = pair.finished["prefill"][rid], pair.finished["decode"][rid]
        expected = reference_tokens(ids, max_new, VOCAB)
        event(f"decode outcome: {dec.type} {dec.status_code}")
        aborted_by_client = rid in self.client_aborted["prefill"] | self.client_aborted["decode"]
        if pre.type == "length":
            assert pair.outputs["prefill"][rid] == expected[:1], rid
        else:
            self._check_abort("prefill", rid, pre, dec, ids, inject, aborted_by_client)
        if dec.type == "length":
            assert pair.outputs["decode"][rid] == expected, (rid, self.cfg)
            return
        self._check_abort("decode", rid, dec, pre, ids, inject, aborted_by_client)
        if dec.message in (OOM_LAST_MESSAGE, EXHAUSTED_MESSAGE):
            event(f"decode abort: {dec.message[:30]}")
            assert pair.outputs["decode"][rid] == expected[:len(pair.outputs["decode"][rid])]

    def _check_abort(self, side, rid, reason, peer, ids, inject, by_client):
        assert reason.type == "abort", (side, rid, reason)
        msg = reason.message or ""
        total = getattr(self.pair, side).scheduler.kv.total_tokens
        if reason.status_code == 499:
            assert rid in self.client_aborted[side], (side, rid)
        elif reason.status_code == 400:
            assert "does not fit in the KV cache" in msg or "Out of memory" in msg, msg
            assert len(ids) + 1 > total or "Out of memory" in msg, (side, rid, msg)
            if "Out of memory" in msg:  # the prefill progress guarantee: cannot fit alone
                P = self.cfg["page_size"]
                assert side == "prefill" and -(-(len(ids) + 1) // P) * P > total, (rid, msg)
        elif msg.startswith("Context corruption detected"):
            assert side == "decode" and inject == "corrupt", (rid, msg)
        elif msg == OOM_LAST_MESSAGE:
            assert side == "decode" and reason.status_code == 500
        elif msg == EXHAUSTED_MESSAGE:
            assert side == "decode" and reason.status_code == 500
            assert self.cfg["backup"] == "host_pool", (rid, self.cfg)
        else:
            assert reason.status_code == 500 and msg.startswith("KV transfer failed"), msg
            # A failed transfer has a cause: an injection, a client abort, or the peer ended
            # the request itself (rejected it, aborted it, timed out without it).
            assert inject in ("bootstrap", "transfer", *PEER_DEATHS) or by_client \
                or peer.type == "abort", (side, rid, msg, peer, self.cfg)
            if inject in PEER_DEATHS:
                event(f"peer death: {inject}")


PDMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=10, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_pd_pair_state_machine = PDMachine.TestCase
