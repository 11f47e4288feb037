"""A tensor-parallel rank lost at start-up (issue 59): one that dies before it joins the
group fails start-up within seconds -- naming the rank, its exit code and the last lines it
printed, the dead process reaped and the others stopped -- instead of holding rank 0 in
torch's rendezvous for --watchdog-timeout; a rank of another launcher that never connects
fails it at --dist-timeout, naming the ranks and the address. The offline LLM and the
server. (--watchdog-timeout 60 below only bounds how long the old hang would take.)"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.e2e.server_utils import REPO, child_pids, free_port, pid_alive, rank_pids

ENGINE = {"tp_size": 2, "skip_tokenizer_init": True, "max_total_tokens": 256,
          "watchdog_timeout": 60.0}
FAILS_WITHIN_S = 10.0  # from the rank's death to the error (the old hang: --watchdog-timeout)


def stop_tree(proc: subprocess.Popen, pids) -> None:
    """A test's finally block: the launcher and every process of its tree, by PID."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def kill_first_rank(root: int, killed: dict, stop: threading.Event) -> None:
    """SIGKILL the first rank process that appears under `root` (it is still importing
    torch then: long before it could join); record its pid and when."""
    while not stop.is_set():
        for pid in rank_pids(root):
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, at=time.monotonic())
            return
        time.sleep(0.01)


def assert_reaped(pid: int) -> None:
    with pytest.raises(ChildProcessError):  # waited for: no zombie left
        os.waitpid(pid, os.WNOHANG)


def test_a_rank_killed_before_it_joins_fails_llm_at_once(tiny_model_path):
    """SIGKILL rank 1 as soon as its process appears (it is still importing torch)."""
    import torch.distributed as dist

    from kvstrata import LLM

    killed: dict = {}
    stop = threading.Event()
    cores = os.sched_getaffinity(0)
    killer = threading.Thread(target=kill_first_rank, args=(os.getpid(), killed, stop),
                              daemon=True)
    killer.start()
    try:
        with pytest.raises(RuntimeError) as err:  # (before the fix: torch's DistStoreError)
            LLM(model_path=tiny_model_path, **ENGINE)
        failed_at = time.monotonic()
    finally:
        stop.set()
        killer.join(5)
        for pid in rank_pids():  # only after a failure of this test
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    message = str(err.value)
    assert f"rank 1 (pid {killed['pid']}) exited with code -9 (SIGKILL) before it joined" \
        in message, message
    assert "it printed nothing" in message
    assert failed_at - killed["at"] < FAILS_WITHIN_S
    assert_reaped(killed["pid"])
    assert rank_pids() == []
    assert not dist.is_initialized() and os.sched_getaffinity(0) == cores


def test_a_rank_that_exits_before_joining_is_named_with_its_last_lines(tiny_model_path,
                                                                       monkeypatch):
    """tp 4, rank 2 exits with code 3 after logging a line: the error quotes the line; ranks
    1 and 3, alive, are stopped and reaped too."""
    from kvstrata import LLM

    monkeypatch.setenv("KVSTRATA_DEBUG_RANK_EXIT", "2:3")
    started = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        LLM(model_path=tiny_model_path, **{**ENGINE, "tp_size": 4})
    message = str(err.value)
    assert re.search(r"rank 2 \(pid \d+\) exited with code 3 before it joined the group; its "
                     r"last lines on stderr:\n  \| .*KVSTRATA_DEBUG_RANK_EXIT: rank 2 exits "
                     r"with code 3", message), message
    assert time.monotonic() - started < 30  # the rank starts, logs and exits in a few s
    assert rank_pids() == []  # every rank reaped (a zombie would still be listed)


def test_a_rank_of_another_launcher_that_never_connects_times_out(tiny_model_path):
    """--nnodes 2 with no node 1: rank 0 gives up at --dist-timeout, naming rank 1, the
    address and the launcher it waited for."""
    from kvstrata import LLM

    addr = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        LLM(model_path=tiny_model_path, **ENGINE, nnodes=2, dist_init_addr=addr,
            dist_timeout=2)
    message = str(err.value)
    assert (f"rank 0 waited 2 s (--dist-timeout) for ranks [1] to join the group at {addr}"
            in message), message
    assert f"node 1's launcher -- `kvstrata serve --nnodes 2 --node-rank K --dist-init-addr " \
        f"{addr}`" in message
    assert time.monotonic() - started < 2 + 20  # rank 0's own start-up, then 2 s


def test_a_rank_killed_before_it_joins_ends_serve(tiny_model_path):
    """The issue's reproduction: `serve --tp-size 2`, rank 1 SIGKILLed as soon as it
    appears. The server exits non-zero within seconds (it hung for --watchdog-timeout,
    /health refusing), its log names the rank and how it ended, and no process of its tree
    is left (the rank was a zombie)."""
    port = free_port()
    log_path = f"/tmp/kvstrata-e2e-tp-start-{port}.log"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kvstrata.entrypoints.cli", "serve", "--model-path",
           tiny_model_path, "--host", "127.0.0.1", "--port", str(port), "--tp-size", "2",
           "--max-total-tokens", "256", "--watchdog-timeout", "60"]
    seen: set[int] = set()
    killed: dict = {}
    stop = threading.Event()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        killer = threading.Thread(target=kill_first_rank, args=(proc.pid, killed, stop),
                                  daemon=True)
        killer.start()
        try:
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                seen.update(child_pids(proc.pid))  # every process of its tree, for the end
                time.sleep(0.05)
            exited_at, code = time.monotonic(), proc.poll()
        finally:
            stop.set()
            killer.join(5)
            stop_tree(proc, seen)
    with open(log_path) as f:
        text = f.read()
    assert killed, text[-3000:]
    assert code not in (None, 0), text[-3000:]
    assert exited_at - killed["at"] < 30, text[-3000:]  # (stopping its children takes a few s)
    assert (f"rank 1 (pid {killed['pid']}) exited with code -9 (SIGKILL) before it joined "
            "the group" in text), text[-3000:]
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in seen if pid_alive(p)] == []


def test_a_launcher_whose_ranks_never_reach_node_0_exits(tiny_model_path):
    """`serve --nnodes 2 --node-rank 1` with no node 0: its rank gives up reaching the store
    at --dist-timeout, naming the address, and the launcher exits non-zero naming the
    rank, its code and its last lines."""
    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kvstrata.entrypoints.cli", "serve", "--model-path",
           tiny_model_path, "--tp-size", "2", "--nnodes", "2", "--node-rank", "1",
           "--dist-init-addr", addr, "--dist-timeout", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            ranks = rank_pids(proc.pid) or ranks
            time.sleep(0.05)
        out = proc.communicate(timeout=1 if proc.poll() is None else None)[0].decode()
    except subprocess.TimeoutExpired:
        out = ""
    finally:
        stop_tree(proc, ranks)
    assert proc.returncode == 1, out[-3000:]
    assert f"rank 1 could not reach the group's store at {addr} within 2 s (--dist-timeout)" \
        in out, out[-3000:]
    assert re.search(r"node 1: rank 1 \(pid \d+\) exited with code 1; its last lines", out), \
        out[-3000:]
    assert ranks and not any(pid_alive(p) for p in ranks)
