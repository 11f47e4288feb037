"""Small helpers shared by the server's child processes."""
from __future__ import annotations

import ctypes
import logging
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so that even a SIGKILLed
    launcher leaves no orphan scheduler or detokenizer. Also ignore SIGINT: a Ctrl-C hits
    the whole process group, and the launcher wants to shut children down in order."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the launcher's ordered shutdown still applies
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The parent may already be gone between fork and prctl.
    if os.getppid() == 1:
        os._exit(1)


def exit_now(code: int) -> None:
    """End a server process whose resources were all closed explicitly: flush logs and
    streams, then os._exit. The interpreter's own teardown (module and GC finalisation of
    torch, transformers and the HTTP stack) took 1.2-1.5 s of CPU per process on 2 cores,
    after the work was done -- the larger part of a server's stop time."""
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def setup_child_logging(server_args, name: str) -> None:
    level = str(getattr(server_args, "log_level", "info") or "info").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s",
    )


# Exit status of a scheduler process ended by --watchdog-timeout (EX_SOFTWARE); the api
# process names the cause from it in every error it sends (see describe_exit).
WATCHDOG_EXIT_CODE = 70


# Exit status of a process that lost a tensor-parallel rank (runner/parallel/tp_runner.py).
TP_RANK_LOST_EXIT_CODE = 71


def describe_exit(exitcode: int | None) -> str:
    """How a child process ended, for error messages and logs."""
    if exitcode == WATCHDOG_EXIT_CODE:
        return ("was stopped by its watchdog: one engine step ran longer than "
                "--watchdog-timeout (its log has a state dump)")
    if exitcode == TP_RANK_LOST_EXIT_CODE:
        return ("lost a tensor-parallel rank (a rank process died or stopped answering; "
                "the log names it)")
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"
