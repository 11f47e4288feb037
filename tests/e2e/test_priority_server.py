"""Priority scheduling on a real server (one running request at a time), through the official
openai client: a long low-priority request is preempted by a high-priority one, which finishes
first; with --disable-priority-preemption the high one waits; both outputs equal what each
gives alone; a full queue answers 503 with SGLang's message; the counters reach /metrics."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.e2e.server_utils import ServerProcess

COMMON = ("--served-model-name", "tiny", "--max-total-tokens", "4096", "--context-length",
          "512", "--max-running-requests", "1", "--enable-priority-scheduling")
LONG, SHORT = "Once upon a time in a land far away", "The capital of France is"
# Long enough that the short request, sent once the long one streams, arrives before it ends
# on a loaded box (96 tokens lost that race once in a CI run beside another worker).
LONG_TOKENS = 256


@pytest.fixture(scope="module")
def preempting(tiny_model_path):
    # A longer context than COMMON's (the last --context-length wins): room for the
    # full-queue test's long blockers.
    srv = ServerProcess(tiny_model_path, *COMMON, "--max-queued-requests", "2",
                        "--context-length", "2048")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def waiting(tiny_model_path):
    srv = ServerProcess(tiny_model_path, *COMMON, "--disable-priority-preemption")
    yield srv
    srv.stop()


BLOCKER_TOKENS = 1900  # with the preempting server's --context-length 2048


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def _complete(srv, prompt, max_tokens, priority, client=None):
    return (client or _client(srv)).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, "priority": priority}).choices[0].text


def _load(srv) -> dict:
    load = httpx.get(srv.base_url + "/get_load", timeout=30).json()
    return load[0] if isinstance(load, list) else load


def _race(srv):
    """Start the long low-priority request, and once it streams, the short high-priority
    one; returns (finish order, long text, short text)."""
    order, texts = [], {}
    started = threading.Event()
    short_client = _client(srv)  # made before the race, not in it

    def long_request():
        stream = _client(srv).completions.create(
            model="tiny", prompt=LONG, max_tokens=LONG_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "priority": 0})
        parts = []
        for chunk in stream:
            started.set()
            parts.append(chunk.choices[0].text)
        texts["long"] = "".join(parts)
        order.append("long")

    thread = threading.Thread(target=long_request)
    thread.start()
    assert started.wait(60)
    texts["short"] = _complete(srv, SHORT, 8, 100, short_client)
    order.append("short")
    thread.join(120)
    return order, texts["long"], texts["short"]


def test_high_priority_preempts_the_running_request(preempting):
    order, long_text, short_text = _race(preempting)
    assert order == ["short", "long"]
    # Alone (nothing to preempt it), each gives the same text: the preempted request was
    # recomputed from its committed tokens.
    assert long_text == _complete(preempting, LONG, LONG_TOKENS, 0)
    assert short_text == _complete(preempting, SHORT, 8, 100)
    metrics = httpx.get(preempting.base_url + "/metrics", timeout=30).text
    line = next(ln for ln in metrics.splitlines()
                if ln.startswith("kvstrata:num_preempted_reqs_total"))
    assert float(line.split()[-1]) >= 1


def test_without_preemption_the_high_priority_request_waits(waiting):
    order, long_text, short_text = _race(waiting)
    assert order == ["long", "short"]
    assert short_text == _complete(waiting, SHORT, 8, 100)


def _fill_queue(srv, attempts: int = 3) -> list[threading.Thread]:
    """Three blockers of the same priority at once (one runs, two wait: the queue is full);
    returns their threads once /get_load shows two waiting. On a loaded box the first may
    finish its tokens before the third arrives (the queue never held two): then all three
    are sent again, up to `attempts` times."""
    def blocker(i, go):
        go.wait(30)
        try:
            # Long enough that the queue stays full whatever the order of the arrivals (with
            # 400 tokens the first one finished before the third arrived); aborted after.
            _complete(srv, f"{LONG} {i}", BLOCKER_TOKENS, 0)
        except openai.APIError:
            pass

    for _ in range(attempts):
        go = threading.Event()
        threads = [threading.Thread(target=blocker, args=(i, go)) for i in range(3)]
        for t in threads:
            t.start()
        go.set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(t.is_alive() for t in threads):
            if _load(srv)["num_waiting_reqs"] >= 2:
                return threads
            time.sleep(0.02)
        httpx.post(srv.base_url + "/abort_request", json={"abort_all": True}, timeout=30)
        for t in threads:
            t.join(120)
    raise AssertionError(f"the queue never held two waiting requests: {_load(srv)}")


def test_a_full_queue_is_a_503_for_the_openai_client(preempting):
    """One request runs, two wait (--max-queued-requests 2): a fourth of the same priority
    is refused; the queue drains and the server serves again."""
    threads = []
    try:
        threads = _fill_queue(preempting)
        with pytest.raises(openai.InternalServerError) as err:
            _complete(preempting, SHORT, 4, 0)
        assert err.value.status_code == 503
        assert "The request queue is full." in str(err.value)
    finally:
        httpx.post(preempting.base_url + "/abort_request", json={"abort_all": True},
                   timeout=30)
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert _complete(preempting, SHORT, 4, 0)


def test_bench_serve_reports_ttft_per_priority_class(preempting, tmp_path):
    """`kvstrata bench serve --priority-mix` sends the field and splits TTFT by class (the
    `bench priority` driver runs this load against three server setups)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, "-m", "kvstrata.entrypoints.cli", "bench", "serve",
                    "--base-url", preempting.base_url, "--model", "tiny", "--endpoint",
                    "completions", "--num-prompts", "8", "--concurrency", "2", "--input-len",
                    "8", "--output-len", "4", "--priority-mix", "0.5", "--output-json",
                    str(out), "--output-png", str(tmp_path / "serve.png")],
                   check=True, timeout=300, capture_output=True)
    summary = json.loads(out.read_text())
    assert summary["completed"] == 8
    per_class = summary["per_class"]
    assert set(per_class) == {"high", "low"}
    assert sum(c["completed"] for c in per_class.values()) == 8
    assert all(c["ttft_ms"]["p50"] > 0 for c in per_class.values())


def test_priority_without_priority_scheduling_is_a_503(client):
    """The shared server runs without priority scheduling but with
    --abort-on-priority-when-disabled: a request that gives a priority gets SGLang's 503;
    one that gives none is served."""
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="tiny", prompt=SHORT, max_tokens=2,
                                  extra_body={"priority": 1})
    assert err.value.status_code == 503
    assert "Using priority is disabled for this server" in str(err.value)
    assert client.completions.create(model="tiny", prompt=SHORT, max_tokens=2).choices


def test_bench_priority_ratios():
    from kvstrata.bench.priority import ratios

    def setup(tok_s, high, low):
        return {"output_throughput": tok_s, "per_class": {
            "high": {"ttft_ms": {"p50": high}}, "low": {"ttft_ms": {"p50": low}}}}
    got = ratios({"off": setup(100.0, 50.0, 50.0), "preempt": setup(90.0, 10.0, 100.0)})
    assert got == pytest.approx({"off_high_vs_low_ttft_p50": 1.0,
                                 "preempt_high_vs_low_ttft_p50": 0.1,
                                 "preempt_tok_s_vs_off": 0.9})
