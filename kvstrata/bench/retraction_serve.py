"""The whole-run half of benchmarks/bench_retraction.py: the same load through sglang-router
+ a prefill and a decode server (tcp) whose decode pool is too small for the batch, once per
retraction backup backend, beside a decode pool large enough never to retract (the
baseline), all in one run. Reports output tok/s (and the ratio to the baseline) and the
decode server's retraction counters."""
from __future__ import annotations

import argparse
import tempfile

from kvstrata.bench.pd import disaggregated

# backend -> extra decode-server flags (host_pool: room for every backup at once)
BACKENDS = {"cpu_tensor": (), "host_pool": ("--hicache-ratio", "2.0")}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serve", action="store_true",
                   help="also run the whole-run load through real PD servers")
    p.add_argument("--serve-model", default="smollm2-135m")
    p.add_argument("--serve-prompts", type=int, default=16)
    p.add_argument("--serve-concurrency", type=int, default=16)
    p.add_argument("--serve-input-len", type=int, default=256)
    p.add_argument("--serve-output-len", type=int, default=128,
                   help="long enough that the 16-token decode reserve underestimates")
    p.add_argument("--serve-decode-tokens", type=int, default=2048,
                   help="the pressured decode pool (the batch's final KV is ~3x this)")


def whole_run(args: argparse.Namespace) -> dict:
    ns = argparse.Namespace(
        model=args.serve_model, page_size=16, max_total_tokens=32768,
        num_prompts=args.serve_prompts, concurrency=args.serve_concurrency,
        input_len=args.serve_input_len, output_len=args.serve_output_len, seed=0)
    log_dir = tempfile.mkdtemp(prefix="kvstrata-bench-retraction-")
    small = ("--max-total-tokens", str(args.serve_decode_tokens),
             "--num-reserved-decode-tokens", "16")
    runs = {"no_retraction": disaggregated(ns, "tcp", log_dir, tag="-base")}
    for backend, extra in BACKENDS.items():
        runs[backend] = disaggregated(
            ns, "tcp", log_dir, small + ("--disaggregation-decode-retraction-backup", backend)
            + extra, tag="-" + backend)
    base = runs["no_retraction"]["output_throughput"]
    print(f"\nwhole run (logs {log_dir}): {'setup':14s} {'tok/s':>7s} {'vs base':>8s} "
          f"{'retractions':>11s} {'failed':>6s}")
    for name, s in runs.items():
        s["vs_no_retraction"] = s["output_throughput"] / max(base, 1e-9)
        print(f"{'':37s}{name:14s} {s['output_throughput']:7.1f} {s['vs_no_retraction']:8.2f} "
              f"{s['decode_load'].get('decode_retractions_total', 0):11} {s['failed']:6}")
    return {k: {key: v for key, v in s.items() if key not in ("per_request", "itl_all_ms")}
            for k, s in runs.items()}
