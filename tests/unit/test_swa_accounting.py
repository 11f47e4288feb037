"""Hybrid SWA memory accounting without torch: /get_load and the Prometheus gauges report the
SWA pool beside the full one, the engine refuses a prompt the SWA pool can never hold, and the
integrity check covers the SWA req_to_token rows (engine/engine_core.py, metrics.py,
cache/invariants.py expected_swa_rows)."""
from __future__ import annotations

import pytest

from kvstrata.engine.request import EngineRequest
from kvstrata.metrics import ServerMetrics
from kvstrata.protocol import SamplingParams
from tests.unit.test_swa_pages import ids, make_engine, run


def test_get_load_reports_swa_usage_and_metrics_export_it():
    engine, _ = make_engine(num_pages=128, num_swa=24, P=2, window=6)
    seen = []

    def sample(eng):
        load = eng.get_load()
        seen.append(load)
        assert 0 <= load["num_used_swa_tokens"] <= load["max_total_swa_tokens"] == 48
        assert load["swa_token_usage"] == load["num_used_swa_tokens"] / 48
    run(engine, [(f"r{i}", ids(i, 30), 12) for i in range(3)], on_step=sample)
    # While they run each holds its window; once drained the tree's SWA pages are evictable:
    # used counts neither free nor evictable pages, as num_used_tokens.
    assert max(s["num_used_swa_tokens"] for s in seen) > 0
    assert engine.get_load()["num_used_swa_tokens"] == 0
    m = ServerMetrics("tiny")
    m.set_load(max(seen, key=lambda s: s["swa_token_usage"]))
    text = m.render().decode()
    top = max(s["swa_token_usage"] for s in seen)
    assert f'kvstrata:swa_token_usage{{model_name="tiny"}} {top}' in text
    assert 'kvstrata:num_used_swa_tokens{model_name="tiny"}' in text


def test_no_swa_keys_without_an_swa_pool():
    from kvstrata.engine.engine_core import EngineCore
    from kvstrata.engine.scheduler.core import SchedulerConfig
    from tests.unit.fake_runner import FakeRunner

    engine = EngineCore(FakeRunner(page_size=1, vocab_size=997),
                        SchedulerConfig(num_pages=64, page_size=1))
    assert not any("swa" in k for k in engine.get_load())


def _submit(engine, rid, n, new=4):
    engine.add_request(EngineRequest(rid, ids(7, n), SamplingParams(
        max_new_tokens=new, temperature=0, ignore_eos=True)))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.rid: o for o in engine.step() if o.finished})
    return outs[rid]


def test_a_prompt_the_swa_pool_can_never_hold_is_refused():
    """W = 8, P = 4, 3 SWA pages (12 tokens; start-up allows > W + P). A short prompt and its
    first output token fit (11 tokens: 3 pages); a long one needs its window's 2 pages, the
    page written and the release margin's (4): refused at once (400) instead of aborted for
    out of memory (500) once it decodes past its prompt."""
    engine, _ = make_engine(num_pages=64, num_swa=3, P=4, window=8)
    assert _submit(engine, "fits", 11, new=1).finish_reason.type == "length"
    out = _submit(engine, "never", 40, new=40)
    assert out.finish_reason.type == "abort" and out.finish_reason.status_code == 400, out
    assert "sliding-window KV pool (12 tokens)" in out.finish_reason.message
    assert "needs 16" in out.finish_reason.message
    engine.check_integrity()


@pytest.mark.parametrize("P,window,num_swa", [(4, 8, 4), (1, 8, 10), (16, 8, 3)])
def test_the_bound_is_not_too_strict(P, window, num_swa):
    """A pool of exactly lone_request_tokens(long prompt) serves a prompt 10x the window and a
    long decode alone: the check refuses nothing the engine could serve."""
    engine, _ = make_engine(num_pages=256, num_swa=num_swa, P=P, window=window)
    assert engine.scheduler.kv.swa.lone_request_tokens(80) == num_swa * P
    out, reasons = run(engine, [("long", ids(3, 80), 40)])
    assert len(out["long"]) == 40 and reasons["long"].type == "length", reasons


def test_integrity_catches_a_stale_swa_row_entry():
    """The SWA table's window entries are checked: one wrong entry the next query reads
    fails engine.check_integrity (and the per-step check the tests run under)."""
    engine, runner = make_engine(num_pages=128, num_swa=32, P=2, window=6)
    engine.add_request(EngineRequest("a", ids(1, 20), SamplingParams(
        max_new_tokens=8, temperature=0, ignore_eos=True)))
    engine.step()
    engine.step()
    req = engine.scheduler.running[0]
    pos = req.num_computed_tokens - 2  # inside the next query's window
    good = runner.swa_rows[req.row][pos]
    runner.swa_rows[req.row][pos] = good + 1
    with pytest.raises(AssertionError, match="SWA row"):
        engine.check_integrity()
    runner.swa_rows[req.row][pos] = good
    engine.check_integrity()
