"""GGUF weights kept quantized (runner/cpu/gguf_matmul.py) against baselines timed in the same
run, on the same weights (ours: gguf_matmul.matmul_q8, x's rows quantized to 8-bit blocks,
integer dot products: what a GGUF file's layers run):
  float_act the same packed weights with x kept fp32 (gguf_matmul.matmul: each group
            dequantized to fp32 in registers, float FMAs; a GGUF file's kernel before
            issue 64's 8-bit activations, a quantized HF checkpoint's still);
  memcpy    torch's copy_ of the same packed bytes (what streaming them costs; a copy also
            writes them, so a kernel may beat it by up to ~2x);
  torch_f32 torch F.linear with the weight dequantized to fp32 (what --load-format
            gguf_dequantize gives an fp32 model);
  torch_bf16 torch F.linear with the weight dequantized to bf16;
  kv_bf16   kvstrata's bf16 linear (runner/cpu/packed_linear.py: what a bf16 model
            dequantized at load runs);
  deq_mm    (--prefill) dequantize each weight to fp32 on the fly then torch's matmul;
  blocks32  (K-quants) matmul_q8 with x in 32-value blocks and a float scale step per group
            (KVSTRATA_GGUF_Q8_SUPERBLOCKS=0: the K-quants' kernel before gguf_q8k_run.h's
            super-blocks with integer sub-block scales).
Each ratio `vs X` = X's time / ours (> 1: ours is faster), the median of paired rounds.

Weights: --copies copies of each shape (30 by default: SmolLM2-135M's four layer shapes, qkv
576->960, o 576->576, gate|up 576->3072, down 1536->576, as many as a decode step streams from
RAM), or with --shapes 1b a 1B-model's MLP (2048->8192 gate|up half, 8192->2048 down), 4
copies. K-quants need rows of whole 256-weight super-blocks, so they run with --shapes 1b only
(a Q4_K_M file of SmolLM2 stores its 576-input tensors as Q5_0 / Q8_0), or with --shapes
kquant SmolLM2's down_proj (1536->576) and a 512->1536 stand-in for its 576-input layers, 16
copies, or --shapes head a 512->49152 LM head (SmolLM2's vocabulary), one copy. Weights are
gguf.quants.quantize'd random normals (K-quants: random blocks with small scales: gguf's
Python package has no K-quant quantizer).

  python benchmarks/bench_gguf_linear.py --rows 1 8 32
  python benchmarks/bench_gguf_linear.py --shapes 1b --rows 1 8 32
  python benchmarks/bench_gguf_linear.py --rows 512 --prefill
  python benchmarks/bench_gguf_linear.py --shapes kquant --formats Q4_K Q5_K Q6_K \
      --rows 1 2 3 4 --baselines blocks32 float_act
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.bench.gguf_blocks import weight_rows  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402
from kvstrata.runner.cpu import gguf_matmul  # noqa: E402
from kvstrata.runner.cpu.packed_linear import PackedLinear, kernel_name  # noqa: E402

SHAPES = {"smollm2": (((576, 960), (576, 576), (576, 3072), (1536, 576)), 30),
          "1b": (((2048, 8192), (8192, 2048)), 4),
          "kquant": (((1536, 576), (512, 1536)), 16), "head": (((512, 49152),), 1),
          "tiny": (((256, 40), (512, 24)), 1)}  # (in, out) per weight, copies; tiny: tests
NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def build(qtype: int, shapes, copies: int, rng) -> dict[str, list]:
    """Per kernel, its form of every weight: packed rows, fp32, bf16, kvstrata's bf16 layer,
    and a destination for the memcpy."""
    w = {"ours": [], "torch_f32": [], "torch_bf16": [], "kv_bf16": [], "copy_dst": []}
    for k, n in shapes:
        for _ in range(copies):
            packed = gguf_matmul.prepare(qtype, weight_rows(qtype, n, k, rng))
            f32 = gguf_matmul.dequantize(packed)
            w["ours"].append(packed)
            w["torch_f32"].append(f32)
            w["torch_bf16"].append(f32.bfloat16())
            w["kv_bf16"].append(PackedLinear(f32.bfloat16()))
            w["copy_dst"].append(torch.empty_like(packed.raw))
    return w


def blocks32(x: dict, packed: list) -> list:
    """matmul_q8 with the K-quants on the 32-value activation blocks (the ablation switch)."""
    gguf_matmul.use_superblocks(False)
    try:
        return [gguf_matmul.matmul_q8(x[p.in_features], p) for p in packed]
    finally:
        gguf_matmul.use_superblocks(True)


def kernels(w: dict, prefill: bool, k_quant: bool) -> dict:
    """name -> fn(x, xb), x / xb: {in_features: fp32 / bf16 [M, in_features]} (a bf16 model's
    activations are bf16 already); every weight once."""
    out = {
        "ours": lambda x, xb: [gguf_matmul.matmul_q8(x[p.in_features], p) for p in w["ours"]],
        "float_act": lambda x, xb: [gguf_matmul.matmul(x[p.in_features], p)
                                    for p in w["ours"]],
        "memcpy": lambda x, xb: [d.copy_(p.raw) for d, p in zip(w["copy_dst"], w["ours"])],
        "torch_f32": lambda x, xb: [F.linear(x[f.shape[1]], f) for f in w["torch_f32"]],
        "torch_bf16": lambda x, xb: [F.linear(xb[b.shape[1]], b) for b in w["torch_bf16"]],
        "kv_bf16": lambda x, xb: [layer(xb[layer.in_features]) for layer in w["kv_bf16"]]}
    if k_quant:
        out["blocks32"] = lambda x, xb: blocks32(x, w["ours"])
    if prefill:
        out["deq_mm"] = lambda x, xb: [x[p.in_features] @ gguf_matmul.dequantize(p).T
                                       for p in w["ours"]]
    return out


def timed(fn, clock=time.perf_counter) -> float:
    t = clock()
    fn()
    return clock() - t


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", nargs="+", default=list(NAMES.values()),
                   choices=list(NAMES.values()))
    p.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--copies", type=int, default=None, help="weights per shape")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baselines", nargs="+", default=None,
                   help="time only these baselines (default: all that apply)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prefill", action="store_true",
                   help="also time dequantize + torch fp32 matmul per weight")
    p.add_argument("--cpu-time", action="store_true",
                   help="time CPU seconds of the process (time.process_time), not wall: on a "
                   "box shared with other jobs, with --threads 1, what the kernels cost when "
                   "they run (all threads' CPU, spin-waits included, with more threads)")
    p.add_argument("--out", default="benchmarks/results/gguf_linear.json")
    add_quiet_arg(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = announce_load(args.require_quiet)
    shapes, copies = SHAPES[args.shapes]
    copies = args.copies or copies
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); ours: "
          f"{gguf_matmul.kernel_name()}")
    rng = np.random.default_rng(0)
    clock = time.process_time if args.cpu_time else time.perf_counter
    results = []
    bf16_name = None
    with torch.inference_mode():
        for name in args.formats:
            qtype = {v: k for k, v in NAMES.items()}[name]
            if any(k % gguf_matmul.BLOCKS[qtype][1] for k, _ in shapes):
                print(f"{name}: {args.shapes}'s rows are not whole 256-weight super-blocks "
                      "(a K-quant file stores them as Q5_0 / Q5_1 / Q8_0): see --shapes 1b")
                continue
            weights = build(qtype, shapes, copies, rng)
            bf16_name = kernel_name(weights["kv_bf16"][0])
            fns = kernels(weights, args.prefill, qtype in (12, 13, 14))
            if args.baselines:
                fns = {kn: fn for kn, fn in fns.items() if kn == "ours" or kn in args.baselines}
            mbytes = sum(p.nbytes for p in weights["ours"]) / 2 ** 20
            for m in args.rows:
                x = {k: torch.randn(m, k) for k, _ in shapes}
                xb = {k: v.bfloat16() for k, v in x.items()}
                times = {kname: [] for kname in fns}
                for fn in fns.values():  # warm-up: first-call set-up, caches
                    fn(x, xb)
                for _ in range(args.rounds):
                    for kname, fn in fns.items():
                        times[kname].append(timed(lambda: fn(x, xb), clock))
                row = {"format": name, "rows": m, "weights": len(weights["ours"]),
                       "mib": mbytes}
                row.update({f"{kname}_ms": min(t) * 1e3 for kname, t in times.items()})
                for base in [b for b in fns if b != "ours"]:
                    row[f"vs_{base}"] = statistics.median(
                        b / o for b, o in zip(times[base], times["ours"]))
                row["ours_gb_s"] = mbytes * 2 ** 20 / (row["ours_ms"] / 1e3) / 1e9
                results.append(row)
                ratios = "  ".join(f"vs {b} {row['vs_' + b]:5.2f}x" for b in fns if b != "ours")
                print(f"{name} M={m:<4d} {mbytes:6.1f} MiB  ours {row['ours_ms']:7.2f} ms "
                      f"({row['ours_gb_s']:5.1f} GB/s)  {ratios}", flush=True)
            del weights, fns
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "box_load": load, "clock": clock.__name__, "kernel": gguf_matmul.kernel_name(),
              "kv_bf16_kernel": bf16_name, "shapes": args.shapes, "results": results}
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
