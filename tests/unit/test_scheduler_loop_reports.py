"""SchedulerLoop without sockets or a model: the load it publishes for /get_load (ahead of
control replies and of a finished request's output, rate-limited while busy, always when
idle, never fatal) and the injected slow step that --watchdog-timeout tests rely on."""
from __future__ import annotations

import time

from kvstrata.entrypoints.scheduler_process import SchedulerLoop
from kvstrata.entrypoints.scheduler_watchdog import StepWatchdog
from kvstrata.frontend import ipc


class _Sock:
    def __init__(self):
        self.sent: list = []

    def send(self, data: bytes) -> None:
        self.sent.append(ipc.decode(data, "detokenizer"))


class _Engine:
    def __init__(self, busy: bool = False, broken: bool = False):
        self.busy, self.broken, self.steps = busy, broken, 0

    def get_load(self) -> dict:
        if self.broken:
            raise RuntimeError("no stats")
        return {"num_running_reqs": int(self.busy)}

    def has_unfinished_requests(self) -> bool:
        return self.busy

    def flush_cache(self) -> bool:
        return True

    def step(self) -> list:
        self.steps += 1
        return []


def _loop(engine, watchdog=None) -> tuple[SchedulerLoop, _Sock]:
    sock = _Sock()
    return SchedulerLoop(engine, None, None, sock, watchdog), sock


def test_load_goes_out_ahead_of_the_control_reply():
    loop, sock = _loop(_Engine())
    loop.handle(ipc.ControlReq(call_id=7, op="flush_cache"))
    assert [type(m) for m in sock.sent] == [ipc.LoadReport, ipc.ControlReply]
    assert sock.sent[1].result == {"flushed": True}


def test_busy_reports_are_rate_limited_and_idle_always_reports():
    loop, sock = _loop(_Engine(busy=True))
    for _ in range(20):
        loop.report_load()
    assert len(sock.sent) == 1  # all within 100 ms of the first
    loop.engine.busy = False
    loop.report_load()
    assert len(sock.sent) == 2 and sock.sent[-1].load == {"num_running_reqs": 0}


def _output(rid: str, finished: bool):
    from kvstrata.protocol.request_output import RequestOutput

    return RequestOutput(rid=rid, new_token_ids=[5], finished=finished, finish_reason=None,
                         prompt_tokens=3, completion_tokens=1, cached_tokens=0)


def test_a_step_that_finishes_a_request_reports_ahead_of_its_outputs():
    """Busy (another request, or HiCache writes in flight): a step that only continues
    requests stays inside the interval; one that finishes a request reports first, so its
    client's /get_load or /metrics right after the answer includes that request."""
    loop, sock = _loop(_Engine(busy=True))
    loop.publish([])
    loop.publish([_output("a", False)])
    assert [type(m) for m in sock.sent] == [ipc.LoadReport, ipc.EngineOutputs]
    loop.publish([_output("a", False), _output("b", True)])
    assert [type(m) for m in sock.sent[2:]] == [ipc.LoadReport, ipc.EngineOutputs]


def test_failing_get_load_is_not_fatal(caplog):
    loop, sock = _loop(_Engine(broken=True))
    loop.report_load()
    loop.report_load(force=True)
    assert sock.sent == []
    assert caplog.text.count("get_load() failed") == 1


def test_debug_slow_step_sleeps_in_that_step_only(monkeypatch):
    monkeypatch.setenv("KVSTRATA_DEBUG_SLOW_STEP", "2:0.3")
    dog = StepWatchdog(60, lambda: "", exit_process=lambda code: None)
    loop, _ = _loop(_Engine(busy=True), dog)
    took = []
    for _ in range(3):
        t = time.perf_counter()
        loop.timed_step()
        took.append(time.perf_counter() - t)
    assert took[1] >= 0.3 and took[0] < 0.2 and took[2] < 0.2, took
    assert loop.engine.steps == 3 and dog.steps == 3
