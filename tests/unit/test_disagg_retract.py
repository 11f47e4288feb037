"""Decode retraction with a KV backup (engine/sides/disagg_retract.py) through the loopback PD pair
of tests/unit/pd_fake.py. The fake backup store copies the fake KV of the backed-up pages and
wipes them, so a restore into the wrong pages (or from the wrong backup) changes the tokens;
every run is compared with the co-located reference."""
from __future__ import annotations

import pytest

from kvstrata.engine.scheduler.new_token_ratio import RETRACT_DECODE_STEPS
from kvstrata.engine.sides.disagg_retract import EXHAUSTED_MESSAGE, OOM_LAST_MESSAGE
from kvstrata.protocol import of_type
from kvstrata.protocol.disagg import BackupOp
from tests.unit.fake_runner import reference_tokens
from tests.unit.pd_fake import PDPair
from kvstrata.engine.sides.registry import pd_side

VOCAB = 1000


def prompt(seed, n):
    return [(seed * 131 + i * 17 + 3) % VOCAB for i in range(n)]


def pressure_pair(backend, page_size=1, host_pages=None, n=12, max_new=20, reserved=0):
    """A decode pool about 1/3 of the final KV of n requests of different lengths."""
    prompts = {f"r{i}": prompt(i, 6 + 3 * (i % 7)) for i in range(n)}
    final = sum(len(p) + max_new for p in prompts.values())
    pages = final // 3 // page_size
    if host_pages is None:
        host_pages = pages if backend == "host_pool" else 0
    pair = PDPair(page_size=page_size, decode_pages=pages, decode_cfg={
        "num_reserved_decode_tokens": reserved, "max_running_requests": 8,
        "num_host_pages": host_pages, "disaggregation_decode_retraction_backup": backend})
    for rid, p in prompts.items():
        pair.submit(rid, p, max_new)
    return pair, prompts, max_new


def check_restore_order(store):
    """Restores come back in the retracted queue's order (FIFO); discards leave it."""
    queue = []
    for kind, rid, _ in store.log:
        if kind == "backup":
            queue.append(rid)
        elif kind == "restore":
            assert queue and queue[0] == rid, (rid, queue)
            queue.pop(0)
        elif rid in queue:
            queue.remove(rid)
    assert not queue


@pytest.mark.parametrize("backend", ["cpu_tensor", "host_pool"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_outputs_equal_colocated_under_retraction(backend, page_size):
    pair, prompts, max_new = pressure_pair(backend, page_size)
    pair.run()
    retraction = pd_side(pair.decode.scheduler).retraction
    store = pair.decode_runner.backups
    assert retraction.num_retractions > 0
    for rid, p in prompts.items():
        assert pair.finished["decode"][rid].type == "length", pair.finished["decode"][rid]
        assert pair.outputs["decode"][rid] == reference_tokens(p, max_new, VOCAB), rid
    backups, restores = store.count("backup", backend), store.count("restore", backend)
    assert backups == restores == retraction.num_retractions > 0
    assert store.count("backup") == backups  # only the resolved backend is used
    load = pair.decode.get_load()
    assert load["decode_retractions_total"] == load["num_retractions"] == backups
    assert load[f"decode_backups_{backend}"] == load[f"decode_restores_{backend}"] == backups
    other = "host_pool" if backend == "cpu_tensor" else "cpu_tensor"
    assert load[f"decode_backups_{other}"] == 0 and load["num_decode_retracted"] == 0
    backed_tokens = sum(op.num_tokens for so in pair.decode_runner.steps for op in of_type(so.ops, BackupOp) if op.kind == "backup")
    assert load["decode_backup_bytes"] == backed_tokens * pair.decode.kv_plan.bytes_per_token
    assert load["decode_backup_exhausted_aborts"] == 0 and load["decode_retraction_backup"] == backend
    check_restore_order(store)
    # The prompt was transferred once per request: restores never go back to prefill.
    assert pair.hub.moved_pages == sum(-(-len(p) // page_size) for p in prompts.values())


def test_small_host_pool_aborts_exactly_the_backups_that_do_not_fit():
    pair, prompts, max_new = pressure_pair("host_pool", host_pages=24)
    pair.run()
    retraction = pd_side(pair.decode.scheduler).retraction
    failed = {rid for rid, r in pair.finished["decode"].items() if r.type == "abort"}
    assert failed and len(failed) == retraction.exhausted_aborts
    assert retraction.num_retractions > 0  # others were backed up and restored
    for rid, p in prompts.items():
        expected = reference_tokens(p, max_new, VOCAB)
        got = pair.outputs["decode"][rid]
        if rid in failed:
            reason = pair.finished["decode"][rid]
            assert reason.status_code == 500 and reason.message == EXHAUSTED_MESSAGE
            assert got == expected[:len(got)]  # what it streamed was right
        else:
            assert pair.finished["decode"][rid].type == "length" and got == expected, rid
    assert pair.decode.get_load()["decode_backup_exhausted_aborts"] == len(failed)
    # PDPair.run -> check_drained: device and host pools whole, no backup left anywhere.


@pytest.mark.parametrize("backend", ["cpu_tensor", "host_pool"])
def test_abort_of_a_retracted_request_discards_its_backup(backend):
    pair, prompts, max_new = pressure_pair(backend)
    retraction = pd_side(pair.decode.scheduler).retraction
    for _ in range(2000):
        pair.step()
        if retraction.retracted:
            break
    victim = retraction.retracted[0]
    host_held = len(retraction.backups[victim.rid].host_pages)
    assert (host_held > 0) == (backend == "host_pool")
    free_before = (pair.decode.scheduler.kv.host_allocator.available_pages()
                   if backend == "host_pool" else 0)
    pair.abort(victim.rid, "decode")
    pair.decode.check_integrity()
    if backend == "host_pool":
        assert (pair.decode.scheduler.kv.host_allocator.available_pages()
                == free_before + host_held)
    pair.abort(victim.rid, "decode")  # twice: nothing more happens
    pair.run()
    store = pair.decode_runner.backups
    assert [k for k, rid, _ in store.log if rid == victim.rid][-1] == "discard"
    assert pair.finished["decode"][victim.rid].status_code == 499
    for rid, p in prompts.items():
        if rid != victim.rid:
            assert pair.outputs["decode"][rid] == reference_tokens(p, max_new, VOCAB), rid


def test_retracted_requests_resume_before_any_admission():
    pair, prompts, max_new = pressure_pair("cpu_tensor", n=16)
    pd = pd_side(pair.decode.scheduler)
    admissions = []
    original = pd._admit

    def admit():
        assert not pd.retraction.retracted, "admission while retracted requests wait"
        admissions.append(pair.steps)
        original()

    pd._admit = admit
    saw_retracted = False
    while pair.busy():
        pair.step()
        saw_retracted |= bool(pd.retraction.retracted)
    pair.check_drained()
    assert saw_retracted and admissions
    check_restore_order(pair.decode_runner.backups)
    for rid, p in prompts.items():
        assert pair.outputs["decode"][rid] == reference_tokens(p, max_new, VOCAB)


def test_sglang_retraction_order_and_ratio():
    # Same output length for all (admitted together): the longest prompt goes first.
    lens = {"a": 10, "b": 14, "c": 12}
    pair = PDPair(page_size=1, decode_pages=48, decode_cfg={
        "num_reserved_decode_tokens": 0, "max_running_requests": 8})
    for rid, n in lens.items():
        pair.submit(rid, prompt(len(rid) + n, n), 12)
    sched = pair.decode.scheduler
    while not pd_side(sched).retraction.retracted:
        pair.step()
    first = pair.decode_runner.backups.log  # applied at the next step
    retracted = [r.rid for r in pd_side(sched).retraction.retracted]
    assert retracted == ["b"]
    remaining = sched.running
    expected = min(1.0, (sum(len(r.output_ids) for r in remaining)
                         + RETRACT_DECODE_STEPS * len(remaining))
                   / (sum(r.params.max_new_tokens for r in remaining) + 1))
    assert sched.ratio.value == pytest.approx(expected)
    pair.run()
    assert first[0][:2] == ("backup", "b")
    for rid, n in lens.items():
        assert pair.outputs["decode"][rid] == reference_tokens(prompt(len(rid) + n, n), 12, VOCAB)


def test_the_last_running_request_is_never_retracted():
    pair = PDPair(page_size=1, decode_pages=12, decode_cfg={"num_reserved_decode_tokens": 0})
    pair.submit("x", prompt(3, 10), 5)
    pair.run()
    reason = pair.finished["decode"]["x"]
    assert reason.status_code == 500 and reason.message == OOM_LAST_MESSAGE
    assert pd_side(pair.decode.scheduler).retraction.num_retractions == 0
    assert pair.outputs["decode"]["x"] == reference_tokens(prompt(3, 10), 3, VOCAB)


def test_dump_state_lists_the_retracted_queue():
    pair, _, _ = pressure_pair("host_pool")
    retraction = pd_side(pair.decode.scheduler).retraction
    while not retraction.retracted:
        pair.step()
    dump = pair.decode.dump_state()
    assert "retracted: " in dump and "retraction (host_pool): retracted" in dump
    pair.run()
