"""The int8 GEMMs of a SmolLM2 decode step: kvstrata's own VNNI GEMM against oneDNN's int8
linear (the two `--quantization w8a8_int8` paths of runner/int8_linear.py), in one run.

Each round builds nothing new: 30 weights of each of SmolLM2's four layer shapes (qkv
576->960, o 576->576, gate|up 576->3072, down 1536->576) per kernel, so that every call reads
its weights from RAM as in a real step, and times one pass over all of them per kernel,
interleaved; the ratio is oneDNN's time / ours (> 1: ours is faster), median of the rounds.
Both produce the same values bit for bit (checked here on the first weight of each shape).

  python benchmarks/bench_int8_gemm.py --rows 1 8 32 64 128 512 2048
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402
from kvstrata.runner.int8_linear import Int8MatmulLinear, own_gemm_fits  # noqa: E402

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # in -> out


def build(kernel: str, copies: int) -> list[Int8MatmulLinear]:
    saved = os.environ.get("KVSTRATA_CPU_INT8_GEMM")
    os.environ["KVSTRATA_CPU_INT8_GEMM"] = kernel  # read when a layer packs its weight
    try:
        torch.manual_seed(0)
        return [Int8MatmulLinear(torch.randn(n, k), torch.randn(n))
                for k, n in SHAPES for _ in range(copies)]
    finally:
        if saved is None:
            os.environ.pop("KVSTRATA_CPU_INT8_GEMM")
        else:
            os.environ["KVSTRATA_CPU_INT8_GEMM"] = saved


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512, 2048])
    p.add_argument("--copies", type=int, default=30, help="weights per shape (30: a step)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", default="benchmarks/results/int8_gemm.json")
    add_quiet_arg(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = announce_load(args.require_quiet)
    if not own_gemm_fits(576, 960):
        print("this CPU has no AVX512-VNNI (or KVSTRATA_CPU_INT8_GEMM=onednn): nothing to compare")
        return {}
    ours, onednn = build("auto", args.copies), build("onednn", args.copies)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.dtype}")
    rows_out = []
    with torch.inference_mode():
        for m in args.rows:
            x = {k: torch.randn(m, k).to(dtype) for k, _ in SHAPES}
            for i in range(0, len(ours), args.copies):  # same values, both kernels
                a, b = ours[i], onednn[i]
                assert torch.equal(a(x[a.in_features]), b(x[b.in_features])), (m, i)
            times = {"kvstrata": [], "onednn": []}
            for _ in range(args.rounds):
                for name, layers in (("kvstrata", ours), ("onednn", onednn)):
                    t = time.perf_counter()
                    for layer in layers:
                        layer(x[layer.in_features])
                    times[name].append(time.perf_counter() - t)
            ratio = statistics.median(o / k for o, k in zip(times["onednn"], times["kvstrata"]))
            ops = sum(2 * m * layer.in_features * layer.out_features for layer in ours)
            best = min(times["kvstrata"])
            row = {"rows": m, "calls": len(ours), "kvstrata_ms": best * 1e3,
                   "onednn_ms": min(times["onednn"]) * 1e3, "ratio": ratio,
                   "kvstrata_gops": ops / best / 1e9}
            rows_out.append(row)
            print(f"M={m:<5d} {len(ours)} calls  kvstrata {row['kvstrata_ms']:8.2f} ms  oneDNN "
                  f"{row['onednn_ms']:8.2f} ms  ratio {ratio:5.2f}x  "
                  f"({row['kvstrata_gops']:.0f} GOP/s)", flush=True)
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "dtype": args.dtype, "box_load": load, "results": rows_out}
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
