"""--watchdog-timeout: turn a stuck engine step into a fast, explained failure.

SGLang runs a thread next to its scheduler loop that compares the forward counter against a
deadline; when one batch runs past --watchdog-timeout it dumps the process and signals the
parent, which kills the server. We do the same job our own way: the scheduler loop marks the
start and end of every engine step, a daemon thread checks the open step every
min(1 s, timeout / 4), and on a timeout it logs a state dump (EngineCore.dump_state() when
the engine has it, else its get_load() dict) plus every thread's Python stack, then ends the
scheduler process with WATCHDOG_EXIT_CODE. The API process watches the scheduler's exit
(frontend/tokenizer_manager.py): it turns /health 503, fails every in-flight request with the
reason read from this exit code, and exits non-zero so a supervisor restarts the server.

Limit: a step stuck in C code that holds the GIL starves this thread too; the API process's
backstop (no output for in-flight requests for twice the timeout) still ends the server.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from kvstrata import envs
from kvstrata.frontend.process_utils import WATCHDOG_EXIT_CODE

logger = logging.getLogger(__name__)


def engine_state_dump(engine) -> str:
    """What the engine can tell about itself: queues, running requests, pool usage."""
    dump_state = getattr(engine, "dump_state", None)
    if callable(dump_state):
        return str(dump_state())
    return json.dumps(engine.get_load(), indent=1, sort_keys=True, default=repr)


class StepWatchdog:
    def __init__(self, timeout_s: float, dump: Callable[[], str],
                 exit_process: Callable[[int], object] = os._exit):
        self.timeout_s = timeout_s
        self.dump = dump
        self.exit_process = exit_process
        self.poll_s = min(1.0, timeout_s / 4)
        self.steps = 0
        self._step_started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-watchdog",
                                        daemon=True)

    def start(self) -> "StepWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @contextmanager
    def step(self):
        """Wrap one engine step: the watchdog only times what runs inside."""
        self.steps += 1
        self._step_started = time.monotonic()
        try:
            yield self.steps
        finally:
            self._step_started = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            started = self._step_started
            if started is not None and time.monotonic() - started > self.timeout_s:
                self._fire(time.monotonic() - started)
                return

    def _fire(self, elapsed: float) -> None:
        logger.error("watchdog timeout: scheduler step %d has run for %.1f s, longer than "
                     "--watchdog-timeout %g s; dumping state and exiting with code %d",
                     self.steps, elapsed, self.timeout_s, WATCHDOG_EXIT_CODE)
        try:
            state = self.dump()
        except Exception as e:  # the dump must never stop the exit
            state = f"(state dump failed: {e!r})"
        logger.error("scheduler state at the watchdog timeout:\n%s", state)
        print("Python stacks of the scheduler process at the watchdog timeout:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for handler in logging.getLogger().handlers:
            handler.flush()
        self.exit_process(WATCHDOG_EXIT_CODE)


def slow_step_from_env() -> tuple[int, float] | None:
    """KVSTRATA_DEBUG_SLOW_STEP="N:SECONDS" -> (N, SECONDS), or None when unset."""
    raw = envs.KVSTRATA_DEBUG_SLOW_STEP.get().strip()
    if not raw:
        return None
    step, _, seconds = raw.partition(":")
    try:
        n, s = int(step), float(seconds)
    except ValueError:
        n, s = 0, -1.0
    if n < 1 or s < 0:
        raise ValueError(f"environment variable KVSTRATA_DEBUG_SLOW_STEP={raw!r} must be "
                         "N:SECONDS with N >= 1 and SECONDS >= 0")
    return n, s
