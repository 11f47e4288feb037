"""`kvstrata bench priority`: a saturated server with mixed traffic (a fraction of the requests
high priority, the rest low), served three ways in one run: priority scheduling off, on with
preemption, on without preemption. Reports TTFT p50/p99 per class and total output tok/s;
the figures that matter are ratios within the run (high vs low TTFT with preemption; tok/s vs
priority off), never bare timings.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile

import httpx

from kvstrata.bench.box_load import add_quiet_arg, announce_load
from kvstrata.bench.pd import Proc, free_port, serve_cmd
from kvstrata.bench.serve_client import run_benchmark, summarize

SETUPS = {
    "off": (),
    "preempt": ("--enable-priority-scheduling",),
    "no_preempt": ("--enable-priority-scheduling", "--disable-priority-preemption"),
}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m", help="a dir, a .gguf or a short name")
    add_quiet_arg(ap)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64, help="prompt words (~tokens)")
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals in req/s (default: all at once: saturated)")
    ap.add_argument("--priority-mix", type=float, default=0.2, help="fraction high priority")
    ap.add_argument("--max-running-requests", type=int, default=8)
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)


def _load_args(args, base_url: str) -> argparse.Namespace:
    return argparse.Namespace(
        base_url=base_url, model="bench", api_key=None, endpoint="completions",
        dataset="random", num_prompts=args.num_prompts, num_turns=1, concurrency=None,
        request_rate=args.request_rate, input_len=args.input_len, output_len=args.output_len,
        temperature=0.0, ignore_eos=True, usage=True, extra_body=None, timeout=600.0,
        seed=args.seed, priority_mix=args.priority_mix, high_priority=100, low_priority=0)


def serve_once(args, setup: str, log_dir: str) -> dict:
    port = free_port()
    srv = Proc(f"priority-{setup}", serve_cmd(
        args, port, "--max-running-requests", str(args.max_running_requests),
        *SETUPS[setup]), log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        srv.wait_http(url + "/health")
        httpx.post(url + "/v1/completions", json={"model": "bench", "prompt": "warm up",
                                                  "max_tokens": 2}, timeout=300)
        ns = _load_args(args, url)
        results, duration = asyncio.run(run_benchmark(ns))
        summary = summarize(results, duration, ns)
        summary.pop("per_request", None)
        summary.pop("itl_all_ms", None)
        load = httpx.get(url + "/get_load", timeout=30).json()
        load = load[0] if isinstance(load, list) else load
        summary["num_preempted_reqs"] = load.get("num_preempted_reqs", 0)
        return summary
    finally:
        srv.stop()


def run(args: argparse.Namespace) -> dict:
    result = {"box_load": announce_load(args.require_quiet), "setups": {}}
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-priority-") as log_dir:
        for setup in args.setups:
            result["setups"][setup] = serve_once(args, setup, log_dir)
    result["ratios"] = ratios(result["setups"])
    print_report(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def ratios(setups: dict) -> dict:
    out = {}
    for name, s in setups.items():
        cls = s.get("per_class", {})
        if "high" in cls and "low" in cls and cls["low"]["ttft_ms"]["p50"]:
            out[f"{name}_high_vs_low_ttft_p50"] = (cls["high"]["ttft_ms"]["p50"]
                                                   / cls["low"]["ttft_ms"]["p50"])
        if "off" in setups and name != "off":
            out[f"{name}_tok_s_vs_off"] = (s["output_throughput"]
                                           / max(setups["off"]["output_throughput"], 1e-9))
    return out


def print_report(result: dict) -> None:
    print("\n==== bench priority (TTFT ms per class; tok/s) ====")
    for name, s in result["setups"].items():
        parts = [f"{name:>10s}: {s['output_throughput']:7.1f} tok/s, "
                 f"{s['completed']}/{s['num_requests']} ok, preempted "
                 f"{s['num_preempted_reqs']}"]
        for cls, st in s.get("per_class", {}).items():
            t = st["ttft_ms"]
            parts.append(f"{cls} p50 {t['p50']:.0f} p99 {t['p99']:.0f}")
        print(" | ".join(parts))
    for key, value in result["ratios"].items():
        print(f"{key}: {value:.2f}")


__all__ = ["add_args", "run"]
