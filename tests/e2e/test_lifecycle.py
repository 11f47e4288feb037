"""Server processes: --api-key, ordered shutdown leaving no process behind, and a dead
scheduler (killed, or its engine loop raising) failing in-flight requests at once, naming the
cause, and taking the server down (exit non-zero) instead of hanging."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.server_utils import ServerProcess, pid_alive

ARGS = ("--context-length", "512", "--max-total-tokens", "8192", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def keyed_server(tiny_model_path):
    srv = ServerProcess(tiny_model_path, *ARGS, "--api-key", "sekrit", "--no-enable-metrics")
    yield srv
    srv.stop()


def test_api_key(keyed_server):
    import openai

    url = keyed_server.base_url
    body = {"prompt": "x", "max_tokens": 1}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 404  # --no-enable-metrics
    ok = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
    assert ok.completions.create(model="tiny", **body).usage.completion_tokens == 1
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_sigterm_leaves_no_process(keyed_server):
    children = keyed_server.children
    assert len(children) >= 2  # scheduler + detokenizer (+ resource tracker)
    rc = keyed_server.stop(signal.SIGTERM)
    assert rc is not None
    alive = [p for p in [keyed_server.proc.pid, *children] if pid_alive(p)]
    assert alive == []


def _health_code(url):
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except (httpx.ConnectError, httpx.RemoteProtocolError):  # gone, or going
        return None


def test_scheduler_death_fails_requests_then_exits(tiny_model_path):
    """SIGKILL the scheduler under a stream and a non-streaming request: /health is 503 at
    once, both requests get errors promptly, and the server exits non-zero (like SGLang) so
    a supervisor can restart it, leaving no process behind."""
    srv = ServerProcess(tiny_model_path, *ARGS)
    try:
        url = srv.base_url
        sched_pid = httpx.get(url + "/server_info").json()["engine_info"]["pid"]
        long = {"prompt": "x", "max_tokens": 450, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, url + "/v1/completions", json=long, timeout=60)
            lines, health_after_kill = [], None
            start = time.monotonic()
            with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True},
                              timeout=60) as r:
                for line in r.iter_lines():
                    if not line:
                        continue
                    lines.append(line)
                    if len(lines) == 1:  # the stream is live: kill its engine under it
                        os.kill(sched_pid, signal.SIGKILL)
                        killed = time.monotonic()
                        # The server may already have drained and exited (refused):
                        # that is just as unhealthy to a router as a 503.
                        while _health_code(url) not in (503, None):
                            assert time.monotonic() - killed < 1.0, "/health still 200"
                        health_after_kill = time.monotonic() - killed
                        # Every route agrees with /health (a router must not keep it),
                        # until the server has exited (then nothing answers at all).
                        for route in ("/v1/models", "/model_info", "/get_load"):
                            try:
                                code = httpx.get(url + route, timeout=5).status_code
                            except (httpx.ConnectError, httpx.RemoteProtocolError,
                                    httpx.ReadError):
                                # exited, or closing its sockets as it exits (a request
                                # it had accepted is then reset: ECONNRESET)
                                break
                            assert code == 503, route
            assert time.monotonic() - start < 10, "in-flight stream hung after the kill"
            assert health_after_kill is not None
            assert any('"error"' in ln and "scheduler" in ln for ln in lines), lines[-3:]
            assert lines[-1] == "data: [DONE]"
            resp = plain.result(timeout=10)
        assert resp.status_code == 500 and "scheduler" in resp.json()["error"]["message"]
        rc = srv.proc.wait(timeout=30)
        assert rc != 0, "the server must exit non-zero after its engine died"
        assert "stopping the server" in srv.read_log()
    finally:
        srv.stop()
    assert [p for p in [srv.proc.pid, *srv.children] if pid_alive(p)] == []


def test_engine_exception_names_the_scheduler_and_its_cause(tiny_model_path):
    """An exception in the scheduler's engine loop (a bug) used to tell the detokenizer to
    stop cleanly first, so requests failed with "the detokenizer process exited with code
    0". The cause now reaches the api server ahead of any exit: requests in flight fail
    with it, an ordinary one beside them too, and the server exits 1, leaving no process."""
    from tests.e2e import failing_engine

    srv = ServerProcess(tiny_model_path, *ARGS, env={
        "KVSTRATA_ENGINE_FACTORY": "tests.e2e.failing_engine:build_engine"})
    try:
        url = srv.base_url
        ok = httpx.post(url + "/v1/completions", timeout=60,
                        json={"prompt": "x", "max_tokens": 4, "ignore_eos": True})
        assert ok.status_code == 200, ok.text  # the wrapper changes nothing else
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(httpx.post, url + "/v1/completions", timeout=60, json={
                "prompt": "x", "max_tokens": 400, "ignore_eos": True})
            time.sleep(0.3)
            doomed = httpx.post(url + "/v1/completions", timeout=60, json={
                "prompt": "y", "max_tokens": failing_engine.FAILING_MAX_TOKENS})
            for resp in (doomed, long.result(timeout=60)):
                assert resp.status_code == 500, resp.text
                assert resp.json()["error"]["message"] == (
                    f"the scheduler process failed: RuntimeError: {failing_engine.MESSAGE}")
        assert srv.proc.wait(timeout=30) == 1
        assert "the engine loop failed" in srv.read_log()
    finally:
        srv.stop()
    assert [p for p in [srv.proc.pid, *srv.children] if pid_alive(p)] == []


def test_bad_page_geometry_fails_start_naming_the_flags(tiny_model_path):
    """Start-up validation runs once, in the scheduler process; a bad flag comes back as one
    clear line (no traceback) and a non-zero exit, not a server that hangs on its first
    chunked prompt."""
    with pytest.raises(RuntimeError) as err:
        ServerProcess(tiny_model_path, "--page-size", "16", "--chunked-prefill-size", "8",
                      timeout=120)
    msg = str(err.value)
    assert "server exited with 1" in msg
    assert ("error: scheduler failed to start: --chunked-prefill-size 8 must be a multiple of "
            "--page-size 16") in msg
