"""The API side of engine failures, without a server: the backstop for a scheduler that is
silent while requests wait, and how a dead engine fails requests and control calls."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from kvstrata.frontend.ipc import IpcPaths
from kvstrata.frontend.tokenizer_manager import EngineDeadError, TokenizerManager, _ReqState
from kvstrata.metrics import ServerMetrics


class _FakeProc:
    sentinel = -1

    def __init__(self):
        self.killed = False

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True


def _tm(proc=None) -> TokenizerManager:
    return TokenizerManager(SimpleNamespace(watchdog_timeout=0.1), None,
                            IpcPaths.in_dir("/nonexistent"), {"num_running_reqs": 0},
                            ServerMetrics("m"), children={"scheduler": proc or _FakeProc()})


def _aborted(tm: TokenizerManager, reason: str) -> float:
    return tm.metrics.registry.get_sample_value(
        "kvstrata:num_aborted_requests_total", {"model_name": "m", "reason": reason})


def test_backstop_kills_a_silent_scheduler_and_fails_waiting_requests():
    async def run():
        proc = _FakeProc()
        tm = _tm(proc)
        state = tm.states["r1"] = _ReqState(asyncio.Queue())
        tm.last_heard = time.monotonic() - 60  # silent far longer than 2 x 0.1 + 10 s
        await asyncio.wait_for(tm._hang_backstop(), 5)
        out = state.queue.get_nowait()
        return tm, proc, out

    tm, proc, out = asyncio.run(run())
    assert proc.killed and tm.engine_dead
    assert out.finished and out.error_status == 500 and "no progress" in out.error_message
    assert _aborted(tm, "engine_dead") == 1


def test_backstop_ignores_silence_without_requests():
    async def run():
        tm = _tm()
        tm.last_heard = time.monotonic() - 60  # idle: nothing in flight, nothing to hear
        task = asyncio.create_task(tm._hang_backstop())
        await asyncio.sleep(1.5)
        task.cancel()
        return tm

    assert not asyncio.run(run()).engine_dead


def test_backstop_counts_silence_from_the_first_waiting_request():
    """An engine idle for longer than the limit, then a request: the silence before it is no
    hang (the backstop killed the test suite's shared server, idle for 10 minutes, as its
    next request arrived)."""
    async def run():
        tm = _tm()
        tm.last_heard = time.monotonic() - 60  # idle for a minute
        tm._wait_for("r1")
        task = asyncio.create_task(tm._hang_backstop())
        await asyncio.sleep(1.5)
        task.cancel()
        return tm

    assert not asyncio.run(run()).engine_dead


def test_dead_engine_refuses_new_work_with_the_reason():
    async def run():
        tm = _tm()
        tm._fail_everything("the scheduler process was killed by SIGKILL")
        assert await asyncio.wait_for(tm.wait_dead(), 1) == \
            "the scheduler process was killed by SIGKILL"
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await tm.control("get_load")
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await anext(tm.generate(SimpleNamespace(rid="r2")))

    asyncio.run(run())
