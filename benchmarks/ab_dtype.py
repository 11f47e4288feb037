"""Two dtypes of SmolLM2 in one process, interleaved: decode steps at each batch size and a
prefill, each dtype on its own ModelRunner, one timed after the other round after round, so
a noisy box hits both alike; the report is the ratio (first dtype's time / second's, > 1:
the second is faster) per round and its median. What `--dtype auto` on a CPU is chosen by
(config/rules/platform_defaults.py): separate servers run one after the other moved by more
than the difference between the dtypes on a shared 2-vCPU box.

  python benchmarks/ab_dtype.py                                  # fp32 vs bf16, 2 threads
  python benchmarks/ab_dtype.py --threads 1 --batch 1 32 --prefill 16x158 1x2048
  python benchmarks/ab_dtype.py --quantization w8a8_int8 --batch 1 32 --prefill
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_decode_step as step_bench  # noqa: E402
from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402
from kvstrata.config.kv_plan import KVPlan  # noqa: E402
from kvstrata.runner.model_runner import ModelRunner  # noqa: E402

PAGE = step_bench.PAGE


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", nargs=2, default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=None, choices=[None, "w8a8_int8"])
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32, 64],
                   help="decode batch sizes (none: no decode)")
    p.add_argument("--context", type=int, default=160, help="decode context per request")
    p.add_argument("--prefill", nargs="*", default=["16x158", "1x2048"],
                   help="prefills as PROMPTSxTOKENS (none: no prefill)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="decode steps per round (the best)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default="benchmarks/results/ab_dtype.json")
    add_quiet_arg(p)
    return p.parse_args(argv)


def runner_for(args, dtype: str, pages: int, rows: int, context: int) -> ModelRunner:
    runner = ModelRunner(args.model, dtype=dtype, device="cpu", quantization=args.quantization)
    d = runner.model.dims
    runner.allocate_kv(KVPlan.mha(num_layers=d.num_layers, num_kv_heads=d.num_kv_heads,
                                  head_dim=d.head_dim, dtype=dtype, page_size=PAGE,
                                  num_pages=pages, num_rows=rows, context_len=context + 1))
    return runner


def interleaved(fns: dict, rounds: int, timed) -> dict:
    """{dtype: [ms per round]}, the dtypes alternating inside each round."""
    times = {dtype: [] for dtype in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for dtype, fn in fns.items():
            times[dtype].append(timed(fn) * 1e3)
    return times


def summarise(name: str, times: dict, dtypes: list[str]) -> dict:
    first, second = (times[d] for d in dtypes)
    ratios = [a / b for a, b in zip(first, second)]
    print(f"{name:<22s} " + "  ".join(f"{d} {statistics.median(times[d]):8.1f} ms"
                                      for d in dtypes)
          + f"  {dtypes[0]}/{dtypes[1]} {statistics.median(ratios):.2f}x (rounds "
          + " ".join(f"{r:.2f}" for r in ratios) + ")", flush=True)
    return {"ms": {d: times[d] for d in dtypes}, "ratios": ratios,
            "median_ratio": statistics.median(ratios)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = announce_load(args.require_quiet)
    prefills = [tuple(int(v) for v in spec.lower().split("x")) for spec in args.prefill]
    rows = sum(args.batch) + sum(p for p, _ in prefills) + 1
    longest = max([args.context] + [n for _, n in prefills])
    pages = (sum(b * (args.context // PAGE + 1) for b in args.batch)
             + sum(p * (n // PAGE + 1) for p, n in prefills) + 2)
    runners = {d: runner_for(args, d, pages, rows, longest) for d in args.dtypes}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"{args.dtypes[0]} vs {args.dtypes[1]}"
          + (f", --quantization {args.quantization}" if args.quantization else ""), flush=True)
    report = {"box_load": load, "threads": torch.get_num_threads(), "dtypes": args.dtypes,
              "quantization": args.quantization, "decode": {}, "prefill": {}}
    try:
        with torch.inference_mode():
            row, page = 1, 1
            for batch in args.batch:
                batches = {d: step_bench.DecodeBatch(r, batch, args.context, row, page)
                           for d, r in runners.items()}
                times = interleaved({d: b.step for d, b in batches.items()}, args.rounds,
                                    lambda fn: min(step_bench._timed(fn)
                                                   for _ in range(args.steps)))
                report["decode"][batch] = summarise(f"decode B={batch} C={args.context}", times,
                                                    args.dtypes)
                row, page = row + batch, next(iter(batches.values())).last_page + 1
                for b in batches.values():
                    b.free()
            for prompts, length in prefills:
                fns = {d: step_bench.prefill_fn(r, prompts, length, row, page)
                       for d, r in runners.items()}
                times = interleaved(fns, args.rounds, step_bench._timed)
                report["prefill"][f"{prompts}x{length}"] = summarise(
                    f"prefill {prompts} x {length}", times, args.dtypes)
                row, page = row + prompts, page + prompts * (length // PAGE + 1)
    finally:  # the runners' worker threads and KV, also after a failed round
        for runner in runners.values():
            runner.shutdown()
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
