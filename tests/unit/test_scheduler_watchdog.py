"""--watchdog-timeout's thread (no server): it fires only for a step longer than the limit,
dumps the engine state, and exits with the watchdog's code; KVSTRATA_DEBUG_SLOW_STEP parses."""
from __future__ import annotations

import threading
import time

import pytest

from kvstrata.entrypoints.scheduler_watchdog import (StepWatchdog, engine_state_dump,
                                                      slow_step_from_env)
from kvstrata.frontend.process_utils import WATCHDOG_EXIT_CODE, describe_exit


class _Recorder:
    def __init__(self):
        self.codes: list[int] = []
        self.fired = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.fired.set()


def test_long_step_fires_with_dump_and_exit_code(caplog):
    exit_ = _Recorder()
    dog = StepWatchdog(0.2, lambda: "QUEUES: waiting=3 running=1", exit_process=exit_).start()
    with caplog.at_level("ERROR"):
        with dog.step():
            assert exit_.fired.wait(5), "the watchdog did not fire on a stuck step"
    assert exit_.codes == [WATCHDOG_EXIT_CODE]
    text = caplog.text
    assert "watchdog timeout" in text and "QUEUES: waiting=3 running=1" in text


def test_short_steps_and_idle_time_never_fire():
    exit_ = _Recorder()
    dog = StepWatchdog(0.3, lambda: "", exit_process=exit_).start()
    try:
        for _ in range(5):
            with dog.step():
                time.sleep(0.05)
        time.sleep(0.8)  # idle between steps is not a stuck step
        assert not exit_.fired.is_set()
    finally:
        dog.stop()


def test_dump_prefers_dump_state_and_falls_back_to_get_load():
    class WithDump:
        def dump_state(self):
            return "full dump"

    class LoadOnly:
        def get_load(self):
            return {"num_running_reqs": 2}

    assert engine_state_dump(WithDump()) == "full dump"
    assert '"num_running_reqs": 2' in engine_state_dump(LoadOnly())


def test_failing_dump_still_exits():
    exit_ = _Recorder()
    dog = StepWatchdog(0.1, lambda: 1 / 0, exit_process=exit_).start()
    with dog.step():
        assert exit_.fired.wait(5)
    assert exit_.codes == [WATCHDOG_EXIT_CODE]


def test_slow_step_env(monkeypatch):
    monkeypatch.delenv("KVSTRATA_DEBUG_SLOW_STEP", raising=False)
    assert slow_step_from_env() is None
    monkeypatch.setenv("KVSTRATA_DEBUG_SLOW_STEP", "3:2.5")
    assert slow_step_from_env() == (3, 2.5)
    for bad in ("3", "0:1", "x:1", "2:-1"):
        monkeypatch.setenv("KVSTRATA_DEBUG_SLOW_STEP", bad)
        with pytest.raises(ValueError, match="KVSTRATA_DEBUG_SLOW_STEP"):
            slow_step_from_env()


def test_describe_exit():
    assert "watchdog" in describe_exit(WATCHDOG_EXIT_CODE)
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(1) == "exited with code 1"
