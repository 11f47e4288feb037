"""kvstrata's fp32 GEMV (runner/cpu/f32_gemv.py; above its rows, kvstrata's fp32 GEMM over the same
panels) against oneDNN's prepacked fp32 linear, with a plain read of the same bytes as the
baseline, all in the same run: SmolLM2's four layer shapes at 1, 2, 4 and 8 rows (--rows: any
count), each over --layers distinct weights so that they stream from RAM as in a decode step.
Interleaved rounds, best of each.

With --model, whole decode steps too: engines of that model (fp32) in this process, one per
KVSTRATA_CPU_F32_GEMV setting (--settings: auto = the GEMV and the GEMM above it, gemv = the
GEMV only, off = oneDNN only), each generating --tokens greedy tokens for --batches prompts at
once, alternated; a step's time is the run's time less a one-token run's (the prefill),
divided by the tokens after the first. --gemm-ab: instead, the fp32 GEMM above the GEMV's rows
on and off inside one engine (separate engines differ by more than that between runs here).

  python benchmarks/bench_gemv.py
  python benchmarks/bench_gemv.py --rows 17 24 32 64 128 512 2048 --layers 4
  python benchmarks/bench_gemv.py --shapes --model smollm2-135m --batches 1 2 4
  python benchmarks/bench_gemv.py --shapes --model smollm2-135m --batches 24 32 64 --gemm-ab
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.engine_ab import engines_by_setting, generate_times  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402
from kvstrata.runner.cpu import f32_gemv  # noqa: E402
from kvstrata.runner.cpu.packed_linear import PackedLinear, packed_linear  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def layer_rows(args) -> list[dict]:
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = [torch.randn(n, k) * 0.02 for _ in range(args.layers)]
        onednn = [PackedLinear(w) for w in weights]
        panels = [f32_gemv.pack(w) for w in weights]
        flat = torch.randn(n * k * args.layers)
        nbytes = flat.numel() * 4
        for m in args.rows:
            x = torch.randn(m, k)
            want = torch.nn.functional.linear(x, weights[0])
            err = (f32_gemv.linear(x, panels[0], None, cap=2, gemm=True) - want
                   ).abs().max().item()
            variants = {
                "gemv": lambda: [f32_gemv.linear(x, p, None, cap=2, gemm=True)
                                 for p in panels],
                "onednn": lambda: [packed_linear(x, p) for p in onednn],
                "read": lambda: flat.sum()}
            best = {v: float("inf") for v in variants}
            for _ in range(args.rounds):
                for v, fn in variants.items():
                    best[v] = min(best[v], _time(fn))
            row = {"shape": name, "n": n, "k": k, "rows": m, "max_abs_err": err,
                   **{f"{v}_gb_s": nbytes / t / 1e9 for v, t in best.items()},
                   "vs_onednn": best["onednn"] / best["gemv"]}
            rows.append(row)
            kind = "GEMV" if m <= f32_gemv.max_rows() else "GEMM"
            print(f"{name:8s} {n:5d} x {k:4d} rows {m}: {kind} {row['gemv_gb_s']:5.1f} GB/s, "
                  f"oneDNN {row['onednn_gb_s']:5.1f}, read {row['read_gb_s']:5.1f}: "
                  f"{row['vs_onednn']:.2f}x oneDNN")
    return rows


def decode_steps(args) -> list[dict]:
    out = []
    with engines_by_setting("KVSTRATA_CPU_F32_GEMV", {v: v for v in args.settings},
                            model_path=args.model, dtype="float32", max_total_tokens=8192,
                            disable_radix_cache=True) as engines:
        base = args.settings[-1]
        for b in args.batches:
            runs = generate_times(engines, b, args.tokens, args.rounds)
            step = {v: (r[args.tokens] - r[1]) / (args.tokens - 1) for v, r in runs.items()}
            row = {"batch": b, **{f"{v}_step_ms": t * 1e3 for v, t in step.items()}}
            row.update({f"{v}_speedup_vs_{base}": step[base] / step[v] for v in step})
            out.append(row)
            print(f"decode step batch {b}: " + ", ".join(
                f"{v} {step[v] * 1e3:6.1f} ms ({step[base] / step[v]:.2f}x {base})"
                for v in args.settings))
    return out


class _GemmToggled:
    """One fp32 engine whose layers take the fp32 GEMM above the GEMV's rows (`on`) or
    oneDNN's layer there: each generate sets every layer's choice and drops the decode plans
    (bound per batch size), so both variants share the engine, its weights and its memory."""

    def __init__(self, llm, on: bool):
        self.llm, self.on = llm, on
        self.model = llm.engine.runner.model
        self.layers = [m for m in self.model.modules()
                       if isinstance(m, PackedLinear) and m.gemv is not None]

    def generate(self, **kwargs):
        for layer in self.layers:
            layer.gemm_f32 = self.on
        for module in self.model.modules():
            module.__dict__.pop("_decode_plans", None)
        return self.llm.generate(**kwargs)


def gemm_steps(args) -> list[dict]:
    """Decode steps with the fp32 GEMM above the GEMV's rows and without (oneDNN's layer),
    toggled inside one engine (KVSTRATA_CPU_F32_GEMV=auto), alternated."""
    from kvstrata import LLM
    out = []
    llm = LLM(model_path=args.model, dtype="float32", max_total_tokens=16384,
              disable_radix_cache=True)
    try:
        variants = {"gemm": _GemmToggled(llm, True), "onednn": _GemmToggled(llm, False)}
        if not any(layer.gemm_f32 for layer in variants["gemm"].layers):
            raise SystemExit("this CPU does not take the fp32 GEMM (AVX-512, or no GEMV "
                             "copies): nothing to compare")
        for b in args.batches:
            runs = generate_times(variants, b, args.tokens, args.rounds)
            step = {v: (r[args.tokens] - r[1]) / (args.tokens - 1) for v, r in runs.items()}
            out.append({"batch": b, "gemm_step_ms": step["gemm"] * 1e3,
                        "onednn_step_ms": step["onednn"] * 1e3,
                        "speedup": step["onednn"] / step["gemm"]})
            print(f"decode step batch {b}: fp32 GEMM {step['gemm'] * 1e3:6.1f} ms, oneDNN "
                  f"{step['onednn'] * 1e3:6.1f} ms: {step['onednn'] / step['gemm']:.2f}x")
    finally:
        llm.shutdown()
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default=None, help="also time whole decode steps of this model")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--tokens", type=int, default=33)
    p.add_argument("--settings", nargs="+", default=["auto", "off"], choices=f32_gemv.CHOICES,
                   help="KVSTRATA_CPU_F32_GEMV of each engine; ratios are against the last")
    p.add_argument("--gemm-ab", action="store_true",
                   help="with --model: the fp32 GEMM above the GEMV's rows on / off in one "
                        "engine (instead of one engine per --settings)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if any(m < 1 for m in args.rows):
        raise ValueError("--rows must be at least 1")
    result = {"args": vars(args), "threads": torch.get_num_threads(), "rows": layer_rows(args)}
    if args.model:
        result["decode"] = gemm_steps(args) if args.gemm_ab else decode_steps(args)
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
