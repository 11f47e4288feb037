"""Time to first streamed chunk with and without sglang-router in front of one co-located
kvstrata server (same client, same prompts, one run): what the router itself adds to TTFT.

    .venv/bin/python benchmarks/bench_router_ttft.py [--requests 6]

Measured 2026-12-02 (docs/benchmarks.md, "Where a PD turn's TTFT goes"): 23.8 ms direct,
67.1 ms through sglang-router 0.3.2 -- its first chunks reach the client together ~43 ms
late (Nagle on the router's client socket meeting Linux's delayed ACK).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstrata.bench import pd  # noqa: E402


def ttft_ms(url: str, n: int) -> list[float]:
    """TTFT of n streamed chats (after one unmeasured)."""
    out = []
    with httpx.Client(base_url=url, timeout=600) as c:
        for i in range(n + 1):
            body = {"model": "bench", "messages": [{"role": "user", "content": f"Say hi {i}"}],
                    "max_tokens": 8, "temperature": 0.0, "stream": True}
            t0, first = time.perf_counter(), None
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line and first is None:
                        first = time.perf_counter() - t0
            if i:
                out.append(1000 * first)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=6)
    a = ap.parse_args()
    args = argparse.Namespace(model=a.model, max_total_tokens=65536, page_size=16)
    log = tempfile.mkdtemp(prefix="router-ttft-")
    port, rport = pd.free_port(), pd.free_port()
    procs = [pd.Proc("server", pd.serve_cmd(args, port), log)]
    try:
        procs[0].wait_http(f"http://127.0.0.1:{port}/health")
        direct = ttft_ms(f"http://127.0.0.1:{port}", a.requests)
        procs.append(pd.Proc("router", [
            sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
            f"http://127.0.0.1:{port}", "--host", "127.0.0.1", "--port", str(rport),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(pd.free_port()),
            "--log-level", "warn"], log))
        procs[1].wait_http(f"http://127.0.0.1:{rport}/health")
        routed = ttft_ms(f"http://127.0.0.1:{rport}", a.requests)
    finally:
        for p in reversed(procs):
            p.stop()
    print(json.dumps({"direct_ttft_p50_ms": round(statistics.median(direct), 1),
                      "router_ttft_p50_ms": round(statistics.median(routed), 1),
                      "router_adds_ms": round(statistics.median(routed)
                                              - statistics.median(direct), 1)}))


if __name__ == "__main__":
    main()
