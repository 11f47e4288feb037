"""sglang-router (0.3.2, regular mode) in front of two kvstrata workers: the router rewrites
every request through SGLang's own schemas (adding no_stop_trim, return_hidden_states,
model: null, log_metrics, ...), and kvstrata must serve them. Driven with the official
openai client, streaming and not, plus /generate; answers through the router equal the
workers' own (greedy), and the round-robin policy reaches both workers."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.conftest import TINY_CONTEXT
from tests.e2e.server_utils import REPO, ServerProcess, free_port, pid_alive

MSG = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0.0, "max_tokens": 8}


def finished_requests(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvstrata:num_requests_total"))


class Router:
    """`mode_args` replaces the regular mode's worker list, e.g. for PD mode
    ["--pd-disaggregation", "--prefill", URL, PORT, "--decode", URL] (then give `workers`)."""

    def __init__(self, worker_urls: list[str], timeout: float = 60,
                 mode_args: list[str] | None = None, workers: int | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/kvstrata-e2e-router-{self.port}.log"
        mode = mode_args or ["--worker-urls", *worker_urls, "--policy", "round_robin"]
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(self.port), *mode, "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--log-level", "warn"]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(workers or len(worker_urls), timeout)

    def _wait_ready(self, workers: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                with open(self.log_path) as f:
                    log = f.read()[-3000:]
                pytest.skip(f"the sglang-router binary cannot run on this machine "
                            f"(exit {self.proc.returncode}):\n{log}")
            try:
                r = httpx.get(self.base_url + "/workers", timeout=2)
                if r.status_code == 200 and _healthy_workers(r.json()) >= workers:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"sglang-router did not register {workers} workers")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _healthy_workers(listing) -> int:
    workers = listing.get("workers", listing) if isinstance(listing, dict) else listing
    return sum(1 for w in workers if not isinstance(w, dict) or w.get("is_healthy", True))


@pytest.fixture(scope="module")
def routed(server, tiny_model_path):
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (pip install -e '.[dev]')")
    second = ServerProcess(tiny_model_path, "--served-model-name", "tiny",
                           "--context-length", str(TINY_CONTEXT))
    router = None
    try:
        router = Router([server.base_url, second.base_url])
        yield router, [server, second]
    finally:
        if router is not None:
            router.stop()
            assert not pid_alive(router.proc.pid)
        second.stop()


def test_openai_client_through_router(routed, client):
    import openai

    router, workers = routed
    via = openai.OpenAI(base_url=router.base_url + "/v1", api_key="none", max_retries=0,
                        timeout=120)
    before = [finished_requests(w.base_url) for w in workers]

    direct = client.chat.completions.create(model="tiny", messages=MSG, **GREEDY)
    for _ in range(2):  # round robin: one call on each worker
        chat = via.chat.completions.create(model="tiny", messages=MSG, **GREEDY)
        assert chat.choices[0].message.content == direct.choices[0].message.content
        assert chat.usage.completion_tokens == direct.usage.completion_tokens
    stream = via.chat.completions.create(model="tiny", messages=MSG, stream=True, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == direct.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == direct.choices[0].finish_reason

    want = client.completions.create(model="tiny", prompt="The sky is", **GREEDY)
    got = via.completions.create(model="tiny", prompt="The sky is", **GREEDY)
    assert got.choices[0].text == want.choices[0].text
    streamed = "".join(c.choices[0].text for c in via.completions.create(
        model="tiny", prompt="The sky is", stream=True, **GREEDY) if c.choices)
    assert streamed == want.choices[0].text

    after = [finished_requests(w.base_url) for w in workers]
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_chat_without_a_model_through_router(routed, client):
    """sglang-router fills a chat request's missing model with "unknown"; kvstrata answers
    it with the served model, as it answers SGLang's own placeholder "default" (a model
    that is named and not served stays a 404)."""
    router, _ = routed
    want = client.chat.completions.create(model="tiny", messages=MSG, **GREEDY)
    body = {"messages": MSG, **GREEDY}
    got = httpx.post(router.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == want.choices[0].message.content
    assert got.json()["model"] == "tiny"
    for model, status in (("default", 200), ("unknown", 200), ("gpt-9", 404)):
        r = httpx.post(router.base_url + "/v1/chat/completions",
                       json={**body, "model": model}, timeout=60)
        assert r.status_code == status, (model, r.text)


def test_generate_through_router(routed, server):
    router, _ = routed
    body = {"text": "The sky is", "sampling_params": {"max_new_tokens": 8,
                                                      "temperature": 0.0}}
    want = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    got = httpx.post(router.base_url + "/generate", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["text"] == want["text"]
    assert got.json()["output_ids"] == want["output_ids"]
    with httpx.stream("POST", router.base_url + "/generate", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == want["text"]
