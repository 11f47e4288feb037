"""Server processes: --api-key, ordered shutdown leaving no process behind, and a dead
scheduler turning into 503 / fast 500s instead of hangs."""
from __future__ import annotations

import os
import signal
import time

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


def test_scheduler_death_fails_fast(tiny_model_path):
    srv = ServerProcess(tiny_model_path, *ARGS)
    try:
        url = srv.base_url
        sched_pid = httpx.get(url + "/server_info").json()["engine_info"]["pid"]
        lines = []
        body = {"prompt": "x", "max_tokens": 450, "ignore_eos": True, "stream": True}
        start = time.monotonic()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 1:  # the stream is live: kill its engine under it
                    os.kill(sched_pid, signal.SIGKILL)
        assert time.monotonic() - start < 10, "in-flight stream hung after the scheduler died"
        result = {"lines": lines}
        assert any('"error"' in ln for ln in result["lines"])
        assert result["lines"][-1] == "data: [DONE]"
        deadline = time.monotonic() + 5
        while httpx.get(url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 500 and r.json()["error"]["message"]
        assert time.monotonic() - start < 2
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
