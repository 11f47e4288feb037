"""PD disaggregation scenarios through a loopback pair (tests/unit/pd_fake.py): a prefill
EngineCore and a decode EngineCore with fake runners and a fake transfer layer that moves the
fake KV page by page. The fake model derives each token from the KV it reads back, so a wrong
or early-reused page changes the output."""
from __future__ import annotations

import pytest

from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.request import EngineRequest
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.engine.sides.disagg_common import BOOTSTRAP_REQUIRED
from kvstrata.protocol import RunnerOutput, SamplingParams, of_type
from kvstrata.protocol.disagg import BootstrapAddr, PDOp
from tests.unit.fake_runner import FakeRunner, reference_tokens
from tests.unit.pd_fake import PDFakeRunner, PDPair
from kvstrata.engine.sides.registry import pd_side

VOCAB = 1000


def prompt(seed, n):
    return [(seed * 131 + i * 17 + 3) % VOCAB for i in range(n)]


def colocated(prompts, max_new, page_size):
    engine = EngineCore(FakeRunner(page_size=page_size, vocab_size=VOCAB),
                        SchedulerConfig(num_pages=512, page_size=page_size))
    out = {rid: [] for rid in prompts}
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(rid, p, SamplingParams(max_new_tokens=max_new,
                                                                temperature=0)))
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.rid] += o.new_token_ids
    return out


@pytest.mark.parametrize("page_size,chunk,delay", [(1, None, 0), (4, 8, 0), (4, 8, 3),
                                                   (16, 16, 1), (2, 3, 2)])
def test_pair_matches_colocated(page_size, chunk, delay):
    pair = PDPair(page_size=page_size, delay=delay, prefill_cfg={"chunked_prefill_size": chunk},
                  decode_cfg={"max_running_requests": 4})
    prompts = {f"r{i}": prompt(i, 3 + 7 * i) for i in range(6)}  # up to 38 tokens: chunked
    for rid, p in prompts.items():
        pair.submit(rid, p, 9)
    pair.run()
    expected = colocated(prompts, 9, page_size)
    for rid, p in prompts.items():
        assert pair.outputs["decode"][rid] == expected[rid] == reference_tokens(p, 9, VOCAB)
        assert pair.finished["decode"][rid].type == "length"
        # The prefill server answers with the first token only, once the KV is sent.
        assert pair.outputs["prefill"][rid] == expected[rid][:1]
        assert pair.finished["prefill"][rid].type == "length"
        first = pair.results["decode"][rid][0]
        assert first.new_token_ids[:1] == expected[rid][:1]
    assert pair.hub.moved_pages == sum(-(-len(p) // page_size) for p in prompts.values())
    # The prefill server never decodes: every forward it ran was a prefill.
    assert all(so.is_prefill for so in pair.prefill_runner.steps if so.scheduled)
    if chunk is not None:
        assert any(not s.sample for so in pair.prefill_runner.steps for s in so.scheduled)
        # Prompts longer than a chunk stream their earlier chunks' pages (last=False).
        for rid, p in prompts.items():
            if len(p) > max(chunk // page_size, 1) * page_size:
                assert pair.hub.links[pair.rooms[rid]].sends >= 2, rid


def test_shared_prefix_hits_prefill_cache_and_reaches_decode():
    pair = PDPair(page_size=4)
    shared = prompt(7, 24)
    pair.submit("a", shared + [5, 6, 7], 4)
    pair.run()
    pair.submit("b", shared + [9, 9], 4)
    pair.run()
    for rid, p in (("a", shared + [5, 6, 7]), ("b", shared + [9, 9])):
        assert pair.outputs["decode"][rid] == reference_tokens(p, 4, VOCAB)
    cached = [o.cached_tokens for o in pair.results["decode"]["b"]]
    assert cached[-1] == 24 == pair.results["prefill"]["b"][-1].cached_tokens
    # The prompt stayed cached on the prefill server after its transfer; none on decode.
    assert pair.prefill.scheduler.kv.tree.cached_pages() > 0
    assert pair.decode.scheduler.kv.tree.cached_pages() == 0


def test_concurrent_shared_prefix_while_first_is_inflight():
    pair = PDPair(page_size=2, delay=6)
    shared = prompt(3, 16)
    pair.submit("a", shared + [1], 3)
    while not pd_side(pair.prefill.scheduler).inflight:  # a's pages in flight (locked in the tree)
        pair.step()
    pair.submit("b", shared + [2, 2], 3)
    pair.run()
    assert pair.results["prefill"]["b"][-1].cached_tokens == 16
    assert pair.outputs["decode"]["b"] == reference_tokens(shared + [2, 2], 3, VOCAB)


def _queue_of(pair, side, rid):
    sched = getattr(pair, side).scheduler
    for name, queue in pd_side(sched).queues().items():
        if any(r.rid == rid for r in queue):
            return name
    if any(r.rid == rid for r in sched.waiting):
        return "waiting"
    if any(r.rid == rid for r in sched.live_requests()):
        return "running"
    return None


@pytest.mark.parametrize("side,queue", [
    ("prefill", "bootstrap"), ("prefill", "waiting"), ("prefill", "running"),
    ("prefill", "inflight"), ("decode", "prealloc"), ("decode", "transfer"),
    ("decode", "prebuilt"), ("decode", "running")])
def test_abort_in_each_queue(side, queue):
    pair = PDPair(page_size=2, delay=4, prefill_cfg={"chunked_prefill_size": 4},
                  decode_cfg={"max_running_requests": 1})
    # "other" occupies the decode batch so that "x" waits in prebuilt for a row.
    pair.submit("other", prompt(1, 6), 40)
    pair.submit("x", prompt(2, 13), 8)
    if queue == "bootstrap" or queue == "prealloc":
        # Hold x's peer back: only one side knows the room for a while.
        pair.hub.inject[pair._rooms + 1000] = {"delay": 50}
    for _ in range(300):
        if _queue_of(pair, side, "x") == queue:
            break
        pair.step()
    else:
        raise AssertionError(f"x never reached {side} {queue}")
    pair.abort("x", side)
    pair.run()
    reason = pair.finished[side]["x"]
    assert reason.type == "abort" and reason.status_code == 499
    assert pair.outputs["decode"]["other"] == reference_tokens(prompt(1, 6), 40, VOCAB)
    peer = "decode" if side == "prefill" else "prefill"
    peer_reason = pair.finished[peer]["x"]
    if side == "decode" and queue in ("prebuilt", "running") or queue == "inflight":
        # the transfer had succeeded, or (prefill inflight) its pages had left
        assert peer_reason.type == "length"
    else:
        assert peer_reason.type == "abort" and peer_reason.status_code == 500, peer_reason
        assert "KV transfer failed" in peer_reason.message


@pytest.mark.parametrize("stage", ["bootstrap", "transfer"])
def test_transfer_failure_is_500_on_both_sides_without_leaks(stage):
    pair = PDPair(page_size=4, delay=2, prefill_cfg={"chunked_prefill_size": 8})
    room = pair._rooms + 1001
    pair.hub.inject[room] = {"fail": stage}
    pair.submit("bad", prompt(5, 21), 6)
    pair.submit("good", prompt(6, 11), 6)
    pair.run()
    for side in ("prefill", "decode"):
        reason = pair.finished[side]["bad"]
        assert reason.type == "abort" and reason.status_code == 500
        assert f"injected {stage} failure" in reason.message
        assert f"bootstrap room {room}" in reason.message
    assert pair.outputs["decode"]["good"] == reference_tokens(prompt(6, 11), 6, VOCAB)
    assert pd_side(pair.decode.scheduler).num_transfer_failures == 1


def test_room_mismatch_is_context_corruption():
    pair = PDPair(page_size=2)
    pair.hub.inject[1001] = {"corrupt": True}
    pair.submit("x", prompt(8, 9), 5)
    pair.run()
    reason = pair.finished["decode"]["x"]
    assert reason.type == "abort" and reason.status_code == 500
    assert reason.message.startswith("Context corruption detected")
    assert pair.outputs["decode"]["x"] == []  # never continued with someone else's KV
    assert pair.finished["prefill"]["x"].type == "length"


def test_decode_pool_too_small_is_400_and_prefill_fails_at_once():
    pair = PDPair(page_size=4, decode_pages=3)  # 12 tokens
    pair.submit("big", prompt(9, 12), 4)
    pair.submit("ok", prompt(10, 6), 4)
    pair.run()
    reason = pair.finished["decode"]["big"]
    assert reason.status_code == 400 and "does not fit in the KV cache" in reason.message
    # The decode side opens and aborts the refused request's room, so the prefill side's
    # half fails on that message, not after the bootstrap timeout.
    prefill = pair.finished["prefill"]["big"]
    assert prefill.status_code == 500 and "the decode server aborted" in prefill.message
    assert pair.outputs["decode"]["ok"] == reference_tokens(prompt(10, 6), 4, VOCAB)


def test_missing_bootstrap_is_400_on_both_servers():
    for mode in ("prefill", "decode"):
        engine = EngineCore(FakeRunner(vocab_size=VOCAB), SchedulerConfig(
            num_pages=64, disaggregation_mode=mode))
        engine.add_request(EngineRequest("x", [1, 2, 3], SamplingParams(max_new_tokens=2)))
        (out,) = engine.step()
        assert out.finish_reason.status_code == 400
        assert out.finish_reason.message == BOOTSTRAP_REQUIRED.format(mode=mode)
        assert "bootstrap_host, bootstrap_port and bootstrap_room" in out.finish_reason.message
        assert not engine.has_unfinished_requests()


def test_duplicate_room_is_400():
    pair = PDPair()
    pair.submit("a", prompt(1, 5), 3, room=77)
    pair.submit("b", prompt(2, 5), 3, room=77)
    pair.run()
    assert pair.finished["decode"]["b"].status_code == 400
    assert "already in use" in pair.finished["decode"]["b"].message
    assert pair.outputs["decode"]["a"] == reference_tokens(prompt(1, 5), 3, VOCAB)


def test_decode_oom_retracts_with_a_backup_instead_of_aborting():
    # No reservation: the decode server admits more than it can grow, then runs out; it
    # backs the victims' KV up and restores it later (tests/unit/test_disagg_retract.py).
    pair = PDPair(page_size=1, decode_pages=40,
                  decode_cfg={"num_reserved_decode_tokens": 0, "max_running_requests": 8})
    prompts = {f"r{i}": prompt(i, 10) for i in range(3)}
    for rid, p in prompts.items():
        pair.submit(rid, p, 12)
    pair.run()
    assert pd_side(pair.decode.scheduler).retraction.num_retractions > 0
    for rid, p in prompts.items():
        assert pair.finished["decode"][rid].type == "length"
        assert pair.outputs["decode"][rid] == reference_tokens(p, 12, VOCAB)


def test_first_token_stops_on_decode_max_new_1_and_eos():
    p = prompt(4, 9)
    first = reference_tokens(p, 1, VOCAB)[0]
    pair = PDPair(eos_token_ids=(first,))
    pair.submit("one", prompt(5, 9), 1)
    pair.submit("eos", p, 10)
    pair.submit("ignore", p, 3, ignore_eos=True)
    pair.run()
    assert pair.outputs["decode"]["one"] == reference_tokens(prompt(5, 9), 1, VOCAB)
    assert pair.finished["decode"]["one"].type == "length"
    assert pair.outputs["decode"]["eos"] == [first]
    assert pair.finished["decode"]["eos"].type == "stop"
    assert pair.outputs["decode"]["ignore"] == reference_tokens(p, 3, VOCAB)
    # A request that ended at its first token never ran a decode forward.
    decoded = {s.rid for so in pair.decode_runner.steps for s in so.scheduled}
    assert decoded == {"ignore"}


class LogprobRunner(PDFakeRunner):
    """Returns a made-up logprob per sampled token (-token / 1000) when asked."""

    def execute(self, so):
        out = super().execute(so)
        wants = {r.rid for r in so.new_requests if r.sampling_params.logprobs is not None}
        self.logprob_reqs = getattr(self, "logprob_reqs", set()) | wants
        lps = [(-t / 1000 if rid in self.logprob_reqs else None)
               for rid, t in zip(out.rids, out.token_ids)]
        return RunnerOutput(out.rids, out.token_ids, lps, [None] * len(lps),
                            events=out.events)


def test_first_token_logprob_travels_to_decode():
    pair = PDPair()
    for side in ("prefill", "decode"):
        runner = getattr(pair, f"{side}_runner")
        runner.__class__ = LogprobRunner
    pair.submit("x", prompt(3, 7), 4, logprobs=0)
    pair.run()
    toks = pair.outputs["decode"]["x"]
    lps = [lp for o in pair.results["decode"]["x"] for lp in (o.new_logprobs or [])]
    assert lps == [-t / 1000 for t in toks]


def test_no_stall_while_waiting_on_inflight_pages_and_polling_steps():
    # The prefill pool holds one prompt: the second waits for the first's transfer (slow).
    pair = PDPair(page_size=4, prefill_pages=4, delay=20)
    pair.submit("a", prompt(1, 14), 3)
    pair.submit("b", prompt(2, 14), 3)
    pair.run()
    for rid, seed in (("a", 1), ("b", 2)):
        assert pair.outputs["decode"][rid] == reference_tokens(prompt(seed, 14), 3, VOCAB)
    assert pair.prefill.scheduler.num_stalls == 0
    # While only transfers were live the engine still stepped (empty outputs = polls).
    assert any(not so.scheduled for so in pair.prefill_runner.steps)


def test_get_load_reports_pd_queues():
    pair = PDPair(delay=5)
    pair.submit("a", prompt(1, 5), 3)
    pair.step()
    load_p, load_d = pair.prefill.get_load(), pair.decode.get_load()
    assert load_p["num_prefill_bootstrap"] == 1 and load_p["num_prefill_inflight"] == 0
    assert load_d["num_decode_prealloc"] == 1 and load_d["num_decode_transfer"] == 0
    assert "num_decode_prebuilt" in load_d
    pair.run()
    assert pair.decode.get_load()["num_decode_prealloc"] == 0


def test_decode_admission_budget_and_extra_slots():
    pair = PDPair(page_size=1, decode_pages=80,
                  decode_cfg={"num_reserved_decode_tokens": 20, "max_running_requests": 2,
                              "disaggregation_decode_extra_slots": 1})
    d = pair.decode.scheduler
    assert d.config.decode_extra_slots == 1 and pd_side(d).max_holding == 3
    for i in range(4):
        pair.submit(f"r{i}", prompt(i, 10), 30)
    peak = 0
    while pair.busy():
        pair.step()
        holding = len(d.running) + len(pd_side(d).transfer) + len(pd_side(d).prebuilt)
        peak = max(peak, holding)
        # 80 free: the first is admitted (idle); then 70 - max(20 x 1, 30 + 10 - 11) = 41
        # >= max(10 + 20, 10 + 30 - 11) admits a second; 41 - 30 = 11 stops the third.
        assert holding <= 2 and len(d.running) <= 2
    assert peak == 2
    for i in range(4):
        assert pair.outputs["decode"][f"r{i}"] == reference_tokens(prompt(i, 10), 30, VOCAB)


def test_extra_slots_default_rule():
    small = SchedulerConfig(num_pages=8, max_running_requests=16)
    big = SchedulerConfig(num_pages=8, max_running_requests=33)
    assert small.decode_extra_slots == 32 and big.decode_extra_slots == 0
    assert SchedulerConfig(num_pages=8, disaggregation_decode_extra_slots=0).decode_extra_slots == 0
    with pytest.raises(ValueError, match="disaggregation-mode"):
        SchedulerConfig(num_pages=8, disaggregation_mode="both")
    from kvstrata.config.kv_plan import KVPlan
    hicache = KVPlan.pages_only(num_pages=8, num_host_pages=8)
    with pytest.raises(ValueError, match="cannot use --enable-hierarchical-cache"):
        SchedulerConfig(hicache, disaggregation_mode="decode")


def test_colocated_has_no_pd_state():
    engine = EngineCore(FakeRunner(), SchedulerConfig(num_pages=16))
    assert pd_side(engine.scheduler) is None
    assert not any(k.startswith("num_prefill_") or k.startswith("num_decode_")
                   for k in engine.get_load())
    engine.add_request(EngineRequest("x", [1, 2], SamplingParams(max_new_tokens=1),
                                     bootstrap=BootstrapAddr("h", 1, 5)))
    while engine.has_unfinished_requests():
        engine.step()


def test_decode_abort_keeps_pages_until_the_late_copy_landed():
    # x's pages are on their way when the decode client aborts: they still land, so the pages
    # must not go to y before the room reports its end (else y's KV is overwritten).
    pair = PDPair(page_size=1, decode_pages=20, decode_cfg={"num_reserved_decode_tokens": 0})
    x_room = pair.submit("x", prompt(1, 8), 4)
    pair.hub.inject[x_room] = {"delay": 30}
    while pair.hub.links.get(x_room) is None or pair.hub.links[x_room].done_tick is None:
        pair.step()
    assert _queue_of(pair, "decode", "x") == "transfer"
    pair.abort("x", "decode")
    pair.submit("y", prompt(2, 4), 12)
    pair.run()
    assert pair.finished["decode"]["x"].status_code == 499
    assert pair.outputs["decode"]["y"] == reference_tokens(prompt(2, 4), 12, VOCAB)


def test_peer_abort_racing_the_last_chunk_drops_the_unsent_send():
    # The decode client aborts while the prefill computes x's last chunk: the FAILED event
    # arrives in the same step as the first token, so the queued send must not go out.
    pair = PDPair(page_size=2, prefill_cfg={"chunked_prefill_size": 4})
    pair.submit("x", prompt(3, 11), 5)
    while not pair.prefill.scheduler.chunked_req:
        pair.step()
    pair.abort("x", "decode")
    pair.run()
    sends = [op for so in pair.prefill_runner.steps for op in of_type(so.ops, PDOp) if op.kind == "send"]
    assert sends and not any(op.last for op in sends)  # earlier chunks only
    assert pair.finished["prefill"]["x"].status_code == 500
    assert "the decode server aborted" in pair.finished["prefill"]["x"].message


def test_scheduler_config_from_args_pd_fields_optional():
    from types import SimpleNamespace

    from kvstrata.config.kv_plan import KVPlan
    plan = KVPlan.pages_only(num_pages=8, page_size=1, num_rows=4, num_host_pages=0)
    base = dict(max_prefill_tokens=64, chunked_prefill_size=None, schedule_policy="fcfs",
                schedule_conservativeness=1.0, disable_radix_cache=False,
                radix_eviction_policy="lru", hicache_write_policy="write_through")
    old = SchedulerConfig.from_args(SimpleNamespace(**base), plan)  # before the flags land
    assert (old.disaggregation_mode, old.num_reserved_decode_tokens,
            old.disaggregation_decode_polling_interval, old.decode_extra_slots) == \
        ("null", 512, 1, 8)
    new = SchedulerConfig.from_args(SimpleNamespace(
        **base, disaggregation_mode="decode", num_reserved_decode_tokens=64,
        disaggregation_decode_extra_slots=2, disaggregation_decode_polling_interval=3), plan)
    assert (new.disaggregation_mode, new.num_reserved_decode_tokens, new.decode_extra_slots,
            new.disaggregation_decode_polling_interval) == ("decode", 64, 2, 3)


def test_integrity_counts_pd_pages_and_dump_shows_pd_queues():
    pair = PDPair(page_size=2, delay=8)
    pair.submit("x", prompt(1, 9), 3)
    while _queue_of(pair, "decode", "x") != "transfer":
        pair.step()
    pair.decode.check_integrity()
    dump = pair.decode.dump_state()
    assert "pd decode: prealloc 0, transfer 1, prebuilt 0" in dump
    assert "transfer: x(prompt=9" in dump and "pages=5" in dump
    x = pd_side(pair.decode.scheduler).transfer[0]
    stolen = x.pages.pop()  # a page nobody accounts for any more
    with pytest.raises(AssertionError, match="KV page leak"):
        pair.decode.check_integrity()
    x.pages.append(stolen)
    while _queue_of(pair, "prefill", "x") != "inflight":
        pair.step()
    pair.prefill.check_integrity()  # inflight: tree-locked prompt path + own last page
    assert pair.prefill.scheduler.kv.tree.protected_pages() == 4
    pair.run()


def test_decode_polling_interval_spaces_admissions():
    pair = PDPair(decode_cfg={"disaggregation_decode_polling_interval": 3})
    pair.submit("x", prompt(1, 5), 2)
    admitted_at = None
    for step in range(1, 20):
        pair.step()
        if admitted_at is None and _queue_of(pair, "decode", "x") != "prealloc":
            admitted_at = step
    assert admitted_at is not None and admitted_at % 3 == 0
    pair.run()
    assert pair.outputs["decode"]["x"] == reference_tokens(prompt(1, 5), 2, VOCAB)
