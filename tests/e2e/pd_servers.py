"""A PD pair of real kvstrata servers for the e2e tests (tests/e2e/test_pd_*.py): start,
generate through both halves as the router does, check that a server drained and leaked
nothing."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import TINY_CONTEXT
from tests.e2e.server_utils import ServerProcess, child_pids, free_port, pid_alive, stop_all
from tests.e2e.test_routes_and_disconnect import kv_state

# Short timeouts so that a dead peer fails a request within seconds, not SGLang's 300 s.
PD_ENV = {"KVSTRATA_DISAGG_WAITING_TIMEOUT": "20", "KVSTRATA_DISAGG_BOOTSTRAP_TIMEOUT": "20",
          "KVSTRATA_DISAGG_HEARTBEAT_INTERVAL": "1", "KVSTRATA_DISAGG_HEARTBEAT_MAX_FAILURE": "2",
          "KVSTRATA_DISAGG_UNREACHABLE_TIMEOUT": "2"}
# A peer's death is noticed within (max_failure + 1) heartbeat intervals; a refused bootstrap
# port within the unreachable timeout. Both bounds, plus slack for a busy 2-core box.
HEARTBEAT_BOUND = 3.0
FAIL_FAST_BOUND = HEARTBEAT_BOUND + 2.0 + 5.0
COMMON = ("--served-model-name", "tiny", "--context-length", str(TINY_CONTEXT),
          "--page-size", "4", "--chunked-prefill-size", "64")


def backend_available(backend: str) -> None:
    if backend == "mooncake" and importlib.util.find_spec("mooncake") is None:
        pytest.fail("mooncake-transfer-engine-non-cuda is not installed: `make test` sets it up")


class PDServers:
    """One prefill and one decode kvstrata server (the decode pool given by its flags).
    `shared_prefill`: another PDServers whose prefill server this pair uses too (the
    session's plain tcp prefill, tests/e2e/conftest.py `tcp_prefill`, or a module
    fixture's, so that tests differing only in the decode server start one prefill). The
    prefill then stays its owner's: a test that kills and restarts it through this pair
    (`pd.prefill = pd.start_prefill(...)`) restarts the owner's, which later pairs use."""

    def __init__(self, model: str, backend: str, *decode_args: str,
                 shared_prefill: "PDServers | None" = None, with_decode: bool = True,
                 prefill_args: tuple = ()):
        self.backend = backend
        self.model = model
        self.decode_args = decode_args
        self.prefill_owner = self if shared_prefill is None else shared_prefill.prefill_owner
        self.owns_prefill = self.prefill_owner is self
        if not self.owns_prefill:
            assert backend == self.prefill_owner.backend and not prefill_args, \
                "a pair on a shared prefill takes its backend and flags"
        self.prefill_args = self.prefill_owner.prefill_args if not self.owns_prefill \
            else prefill_args
        # Both servers start side by side (each spends most of its start importing).
        if self.owns_prefill:
            self.bootstrap_port = free_port()
            self.prefill = self.start_prefill(wait=False)
        else:
            self.bootstrap_port = self.prefill_owner.bootstrap_port
        self.decode = self.start_decode(wait=False) if with_decode else None
        try:
            for srv in (self.prefill if self.owns_prefill else None, self.decode):
                if srv is not None:
                    srv.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def start_decode(self, wait: bool = True, port: int | None = None) -> ServerProcess:
        return ServerProcess(self.model, *COMMON, "--disaggregation-mode", "decode",
                             "--disaggregation-transfer-backend", self.backend,
                             "--max-total-tokens", "2048", *self.decode_args, env=PD_ENV,
                             wait=wait, port=port)

    @property
    def prefill(self) -> ServerProcess:
        return self.prefill_owner.prefill_server

    @prefill.setter
    def prefill(self, srv: ServerProcess) -> None:
        self.prefill_owner.prefill_server = srv

    def revive_prefill(self) -> None:
        """A shared prefill that an earlier test killed and did not restart (it failed
        midway) is started again on its ports, so that one failure does not fail every
        later file that shares it."""
        if self.prefill.proc.poll() is not None:
            self.prefill = self.start_prefill(port=self.prefill.port)

    def start_prefill(self, wait: bool = True, port: int | None = None) -> ServerProcess:
        if not self.owns_prefill:  # the owner's flags and bootstrap port
            return self.prefill_owner.start_prefill(wait, port)
        return ServerProcess(self.model, *COMMON, "--disaggregation-mode", "prefill",
                             "--disaggregation-transfer-backend", self.backend,
                             "--disaggregation-bootstrap-port", str(self.bootstrap_port),
                             "--max-total-tokens", "4096", *self.prefill_args, env=PD_ENV,
                             wait=wait, port=port)

    def body(self, room: int | None = None) -> dict:
        return {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": random.getrandbits(63) if room is None else room}

    def generate(self, text_or_ids, max_new_tokens: int = 8, timeout: float = 60,
                 top: dict | None = None, **sampling) -> list:
        """What the router does: the same body to both servers at once; returns both.
        `top`: more top-level fields of the body (return_logprob, ...)."""
        key = "input_ids" if isinstance(text_or_ids, list) else "text"
        body = {key: text_or_ids, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                      "temperature": 0.0, **sampling},
                **self.body(), **(top or {})}
        out: dict = {}

        def post(name, srv):
            out[name] = httpx.post(srv.base_url + "/generate", json=body, timeout=timeout)
        threads = [threading.Thread(target=post, args=(n, s))
                   for n, s in (("prefill", self.prefill), ("decode", self.decode))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [out["prefill"], out["decode"]]

    def stop(self) -> None:
        stop_all([self.decode, self.prefill if self.owns_prefill else None])


def wait_drained(srv, timeout: float = 30) -> dict:
    """/debug/kv once nothing runs, waits, transfers or writes to the host tier (an async
    HiCache write locks its node's device pages until it ends: checked too early, a drained
    decode server showed 64 used tokens), or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        st = kv_state(srv)
        if (st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0
                and not any(st.get(k) for k in ("num_prefill_bootstrap", "num_prefill_inflight",
                                                "num_decode_prealloc", "num_decode_transfer",
                                                "hicache_busy"))):
            return st
        if time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def wait_for(srv, ready, what: str, timeout: float = 30) -> None:
    """Until ready(kv_state(srv)); fails after `timeout` s saying `what` was not seen."""
    deadline = time.monotonic() + timeout
    while not ready(st := kv_state(srv)):
        assert time.monotonic() < deadline, f"{what} on {srv.base_url} after {timeout} s: {st}"
        time.sleep(0.02)


@contextlib.contextmanager
def paused(srv):
    """The server's whole process tree stopped (SIGSTOP: a stalled peer, its sockets still
    accepting bytes), resumed (SIGCONT) on leaving."""
    pids = [srv.proc.pid, *child_pids(srv.proc.pid)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def assert_no_leak(srv) -> None:
    st = wait_drained(srv)
    assert st["ok"], st
    # Only the radix cache may hold pages once everything has ended.
    assert st["num_used_tokens"] == 0, st


@contextlib.contextmanager
def pd_router(pd: PDServers):
    """sglang-router in PD mode in front of the pair (skips without sglang-router); stopped
    by PID afterwards."""
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (pip install -e '.[dev]')")
    from tests.e2e.test_sglang_router import Router  # noqa: PLC0415 - its own fixtures

    router = Router([], mode_args=["--pd-disaggregation", "--prefill", pd.prefill.base_url,
                                   str(pd.bootstrap_port), "--decode", pd.decode.base_url],
                    workers=2)
    try:
        yield router
    finally:
        router.stop()
        assert not pid_alive(router.proc.pid)


def router_generate(pd: PDServers, ids: list[int], max_new_tokens: int,
                    timeout: float = 60) -> list[int]:
    """One greedy request (ignore_eos) through sglang-router in front of the pair: its
    output ids (a 200 is asserted)."""
    with pd_router(pd) as router:
        r = httpx.post(router.base_url + "/generate", json={
            "input_ids": ids, "sampling_params": {
                "max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}},
            timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@contextlib.contextmanager
def serving(servers: PDServers):
    """Yield the servers; stop both afterwards (a shared prefill stays its owner's) and check
    that no process it stopped survives."""
    try:
        yield servers
    finally:
        servers.stop()
        for srv in (servers.prefill if servers.owns_prefill else None, servers.decode):
            assert srv is None or not pid_alive(srv.proc.pid)
