"""Control routes stay fast under load: while N streams run and one engine step is made to
take SLOW_STEP_S (longer than the bound), /health, /get_load and /metrics each answer within
BOUND_S. /get_load and /metrics used to round-trip through the scheduler's queue and waited
for the step to end."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.e2e.server_utils import ServerProcess

N_STREAMS = 32
BOUND_S = 2.0  # generous for a shared 2-core box, but below SLOW_STEP_S
SLOW_STEP_S = 4.0
ROUTES = ("/health", "/get_load", "/metrics")


async def _stream(client: httpx.AsyncClient, i: int) -> str | None:
    """Run one stream to its end; return its finish_reason."""
    body = {"model": "tiny", "prompt": f"story {i}: " + "word " * 150, "max_tokens": 48,
            "ignore_eos": True, "stream": True}
    finish = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    return finish


async def _probe(client: httpx.AsyncClient, done: asyncio.Event, worst: dict, seen: list):
    while not done.is_set():
        for path in ROUTES:
            t = time.perf_counter()
            r = await client.get(path)
            worst[path] = max(worst[path], time.perf_counter() - t)
            assert r.status_code == 200, (path, r.status_code)
            if path == "/get_load":
                seen.append(r.json()["num_running_reqs"])
        await asyncio.sleep(0.1)


async def _run(base_url: str) -> tuple[list[int], dict, list]:
    limits = httpx.Limits(max_connections=N_STREAMS + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as streams, \
            httpx.AsyncClient(base_url=base_url, timeout=30) as probes:
        done, worst, seen = asyncio.Event(), {p: 0.0 for p in ROUTES}, []
        probe = asyncio.create_task(_probe(probes, done, worst, seen))
        try:
            finishes = await asyncio.gather(*(_stream(streams, i) for i in range(N_STREAMS)))
        finally:
            done.set()
        await probe
        return finishes, worst, seen


def test_control_routes_answer_within_bound_under_load(tiny_model_path):
    srv = ServerProcess(tiny_model_path, "--context-length", "512", "--max-total-tokens",
                        "16384", "--served-model-name", "tiny",
                        env={"KVSTRATA_DEBUG_SLOW_STEP": f"3:{SLOW_STEP_S}"})
    try:
        start = time.monotonic()
        finishes, worst, seen = asyncio.run(_run(srv.base_url))
        elapsed = time.monotonic() - start
        assert elapsed > SLOW_STEP_S  # the slow step happened while the routes were probed
        assert finishes == ["length"] * N_STREAMS, finishes
        assert all(t < BOUND_S for t in worst.values()), worst
        assert max(seen) > 0, "get_load never showed the running requests"
    finally:
        srv.stop()
