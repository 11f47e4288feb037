"""--watchdog-timeout on a real server: one engine step made to hang (KVSTRATA_DEBUG_SLOW_STEP)
is caught by the scheduler's watchdog, which logs a state dump; in-flight requests get
errors naming the watchdog, /health turns 503 and the server exits non-zero, well before
the stuck step would have ended."""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.e2e.server_utils import ServerProcess, pid_alive

STUCK_S = 60  # the injected hang; the watchdog must end things long before it


def test_watchdog_fails_requests_and_exits(tiny_model_path):
    srv = ServerProcess(tiny_model_path, "--context-length", "512", "--max-total-tokens",
                        "8192", "--served-model-name", "tiny", "--watchdog-timeout", "1",
                        env={"KVSTRATA_DEBUG_SLOW_STEP": f"4:{STUCK_S}"})
    try:
        url = srv.base_url
        body = {"prompt": "hang", "max_tokens": 300, "ignore_eos": True}
        start = time.monotonic()
        # The stream goes first and the plain request only once the stream's first chunk is
        # out: a stream still waiting for its first chunk when the step hangs is answered by a
        # plain JSON 500 instead (no stream has begun), which is a different case.
        lines, plain = [], None
        with ThreadPoolExecutor(1) as pool:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                              timeout=60) as r:
                assert r.status_code == 200, r.read()
                for ln in r.iter_lines():
                    if ln and plain is None:
                        plain = pool.submit(httpx.post, url + "/v1/completions", json=body,
                                            timeout=60)
                    if ln:
                        lines.append(ln)
            resp = plain.result(timeout=30)
        assert time.monotonic() - start < STUCK_S / 2
        assert any('"error"' in ln and "watchdog" in ln for ln in lines), lines[-3:]
        assert lines[-1] == "data: [DONE]"
        assert resp.status_code == 500 and "watchdog" in resp.json()["error"]["message"]
        try:
            health = httpx.get(url + "/health", timeout=5).status_code
        except httpx.TransportError:
            health = None  # already gone: also not healthy
        assert health in (503, None)
        assert srv.proc.wait(timeout=30) != 0
        assert time.monotonic() - start < STUCK_S / 2
        with open(srv.log_path) as f:
            log = f.read()
        assert "watchdog timeout: scheduler step 4" in log
        assert "scheduler state at the watchdog timeout" in log
        # EngineCore.dump_state(): queues, running requests, pool usage
        assert re.search(r"waiting \d+, running [12]", log) and "pages: total" in log
        assert "Python stacks of the scheduler process" in log
    finally:
        srv.stop()
    assert [p for p in [srv.proc.pid, *srv.children] if pid_alive(p)] == []
