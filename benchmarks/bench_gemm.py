"""The GEMMs of a SmolLM2 decode step: kvstrata's own kernels against oneDNN's, in one run.

  --kind int8: the two `--quantization w8a8_int8` paths of runner/cpu/int8_linear.py (our VNNI
               GEMM with the row ops fused in, oneDNN's int8 linear between two row passes);
               the same values bit for bit (checked here on the first weight of each shape).
               Without VNNI: our GEMM's AVX2 tile against what ran before it there, fbgemm's
               layer (runner/quant/w8a8.py W8A8Int8Linear, 7-bit activations: the values
               agree to the 7-bit codes' error, checked)
  --kind bf16: a bf16 model's linears (runner/cpu/packed_linear.py: our GEMM -- its AVX512-BF16
               body, or on an AVX2-only CPU its AVX2 body -- against oneDNN's prepacked bf16
               linear, or torch's F.linear where oneDNN has no bf16 kernels: the "onednn"
               column then times F.linear, named in the output); the same up to accumulation
               order (checked to bf16's rounding). Also timed: the same weights in fp32
               through oneDNN's prepacked fp32 linear (`vs_fp32` = its time / ours), the
               float path a bf16 model competes with

Each round builds nothing new: 30 weights of each of SmolLM2's four layer shapes (qkv
576->960, o 576->576, gate|up 576->3072, down 1536->576) per kernel, so that every call reads
its weights from RAM as in a real step, and times one pass over all of them per kernel,
interleaved; the ratio is oneDNN's time / ours (> 1: ours is faster), the median of the
paired rounds (the times printed are each kernel's best round, and the ratio of those bests is
printed in brackets beside the median: on a noisy box the two can differ).

  python benchmarks/bench_gemm.py --kind bf16 --rows 1 8 32 64 128 512 2048
  KVSTRATA_CPU_BF16_GEMM=own python benchmarks/bench_gemm.py --kind bf16   # AMX: ours anyway
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
from kvstrata.runner.cpu import int8_linear  # noqa: E402
from kvstrata.runner.cpu.int8_linear import Int8MatmulLinear, own_gemm_fits  # noqa: E402
from kvstrata.runner.cpu.packed_linear import PackedLinear, kernel_name, own_bf16_fits  # noqa: E402

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # in -> out


# kind -> (the env that picks the kernel, the layer, the weights' dtype)
KINDS = {"int8": ("KVSTRATA_CPU_INT8_GEMM", Int8MatmulLinear, torch.float32),
         "bf16": ("KVSTRATA_CPU_BF16_GEMM", PackedLinear, torch.bfloat16)}


def fbgemm_baseline(kind: str) -> bool:
    """int8 without VNNI: oneDNN's int8 linear is not exact there; fbgemm's layer ran."""
    from kvstrata.runner.quant.w8a8 import cpu_has_vnni
    return kind == "int8" and not int8_linear.available(cpu_has_vnni())


HEAD = (576, 49152)  # SmolLM2's output head (tied to the embedding): one wide GEMM a step


def build(kind: str, kernel: str, copies: int, dtype: torch.dtype | None = None,
          shapes=SHAPES) -> list:
    env, layer, kind_dtype = KINDS[kind]
    if kernel == "onednn" and fbgemm_baseline(kind):
        from kvstrata.runner.quant.w8a8 import W8A8Int8Linear
        layer = W8A8Int8Linear
    dtype = dtype or kind_dtype
    saved = os.environ.get(env)
    os.environ[env] = kernel  # read when a layer packs its weight
    try:
        torch.manual_seed(0)
        return [layer((torch.randn(n, k) / k ** 0.5).to(dtype), torch.randn(n).to(dtype))
                for k, n in shapes for _ in range(copies)]
    finally:
        if saved is None:
            os.environ.pop(env)
        else:
            os.environ[env] = saved


def ours_choice(kind: str) -> str:
    """`own` where the environment forces kvstrata's GEMM (AMX CPUs, where auto leaves the
    layers to oneDNN), else `auto`."""
    return "own" if os.environ.get(KINDS[kind][0], "").strip().lower() == "own" else "auto"


def fits(kind: str) -> bool:
    if kind == "int8":
        return own_gemm_fits(576, 960)
    return own_bf16_fits(torch.empty(960, 576, dtype=torch.bfloat16))


def check_same(kind: str, a, b, x: torch.Tensor, m: int) -> None:
    ya, yb = a(x), b(x)
    if fbgemm_baseline(kind):  # 8-bit against 7-bit activation codes
        err = ((ya.float() - yb.float()).abs().max() / yb.float().abs().max()).item()
        assert err < 0.05, (m, err)
    elif kind == "int8":
        assert torch.equal(ya, yb), m
    else:  # accumulation order differs: one bf16 rounding apart
        torch.testing.assert_close(ya.float(), yb.float(), rtol=1.6e-2, atol=2e-2)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kind", choices=sorted(KINDS), default="int8")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512, 2048])
    p.add_argument("--copies", type=int, default=30, help="weights per shape (30: a step)")
    p.add_argument("--head", action="store_true", help="also time the output head's shape "
                   "(576 -> 49152, one weight) per kernel and row count")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="activations' dtype (int8; bf16 is always bf16)")
    p.add_argument("--out", default=None, help="default benchmarks/results/<kind>_gemm.json")
    p.add_argument("--model", default=None, help="also time whole decode steps and prefills "
                   "of this model, one engine per kernel (int8: --quantization w8a8_int8)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per timed run")
    add_quiet_arg(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = announce_load(args.require_quiet)
    out = args.out or f"benchmarks/results/{args.kind}_gemm.json"
    if not fits(args.kind):
        isa = ("AVX512-VNNI nor AVX2 without VNNI" if args.kind == "int8" else
               "AVX512-BF16 without AMX, nor AVX2 without oneDNN's bf16")
        print(f"this CPU has no {isa} (or {KINDS[args.kind][0]}=onednn): nothing to compare")
        return {}
    ours = build(args.kind, ours_choice(args.kind), args.copies)
    onednn = build(args.kind, "onednn", args.copies)
    dtype = torch.bfloat16 if args.kind == "bf16" else getattr(torch, args.dtype)
    kernels = {"kvstrata": ours, "onednn": onednn}
    if args.kind == "bf16":  # the same weights (same seed) in fp32, oneDNN's prepacked linear
        kernels["fp32"] = build(args.kind, "onednn", args.copies, torch.float32)
        baseline = kernel_name(onednn[0])
        print(f"kvstrata: {kernel_name(ours[0])}; \"onednn\": {baseline}")
    if fbgemm_baseline(args.kind):
        print("kvstrata: its int8 GEMM's AVX2 tile; \"oneDNN\": fbgemm's layer (no VNNI)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.kind}, "
          f"{dtype}")
    rows_out = []
    with torch.inference_mode():
        for m in args.rows:
            x = {k: torch.randn(m, k).to(dtype) for k, _ in SHAPES}
            for i in range(0, len(ours), args.copies):  # same values, both kernels
                check_same(args.kind, ours[i], onednn[i], x[ours[i].in_features], m)
            times = {name: [] for name in kernels}
            for _ in range(args.rounds):
                for name, layers in kernels.items():
                    xs = x if name != "fp32" else {k: v.float() for k, v in x.items()}
                    t = time.perf_counter()
                    for layer in layers:
                        layer(xs[layer.in_features])
                    times[name].append(time.perf_counter() - t)
            ratio = statistics.median(o / k for o, k in zip(times["onednn"], times["kvstrata"]))
            ops = sum(2 * m * layer.in_features * layer.out_features for layer in ours)
            best = min(times["kvstrata"])
            row = {"rows": m, "calls": len(ours), "kvstrata_ms": best * 1e3,
                   "onednn_ms": min(times["onednn"]) * 1e3, "ratio": ratio,
                   "ratio_of_best": min(times["onednn"]) / best,
                   "kvstrata_gops": ops / best / 1e9}
            extra = ""
            if "fp32" in times:
                row["fp32_ms"] = min(times["fp32"]) * 1e3
                row["vs_fp32"] = statistics.median(
                    f / k for f, k in zip(times["fp32"], times["kvstrata"]))
                extra = f"  fp32 {row['fp32_ms']:8.2f} ms  vs fp32 {row['vs_fp32']:5.2f}x"
            rows_out.append(row)
            # ms: the best round; ratio: the median of paired rounds (of the bests in brackets)
            print(f"M={m:<5d} {len(ours)} calls  kvstrata {row['kvstrata_ms']:8.2f} ms  oneDNN "
                  f"{row['onednn_ms']:8.2f} ms  ratio {ratio:5.2f}x "
                  f"({row['ratio_of_best']:4.2f}x)  "
                  f"({row['kvstrata_gops']:.0f} GOP/s){extra}", flush=True)
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "kind": args.kind,
              "dtype": str(dtype).removeprefix("torch."), "box_load": load,
              "kernel": kernel_name(ours[0]) if args.kind == "bf16" else "kvstrata int8 GEMM",
              "baseline": (kernel_name(onednn[0]) if args.kind == "bf16" else
                           "fbgemm int8 (7-bit)" if fbgemm_baseline(args.kind) else "oneDNN int8"),
              "results": rows_out}
    if args.head:
        report["head"] = head_rows(args, dtype)
    if args.model:
        report["decode"] = decode_steps(args, dtype)
    if out:
        write_json(out, report)
    return report


def head_rows(args, dtype: torch.dtype) -> list[dict]:
    """The output head's one GEMM per kernel (ms, best of the rounds) at each row count."""
    layers = {"kvstrata": build(args.kind, ours_choice(args.kind), 1, shapes=(HEAD,))[0],
              "onednn": build(args.kind, "onednn", 1, shapes=(HEAD,))[0]}
    out = []
    with torch.inference_mode():
        for m in args.rows:
            x = torch.randn(m, HEAD[0]).to(dtype)
            best = {}
            for name, layer in layers.items():
                layer(x)
                best[name] = min(_time(layer, x) for _ in range(args.rounds)) * 1e3
            out.append({"rows": m, "kvstrata_ms": best["kvstrata"], "onednn_ms": best["onednn"]})
            print(f"head M={m:<5d} kvstrata {best['kvstrata']:8.2f} ms  oneDNN "
                  f"{best['onednn']:8.2f} ms  ratio {best['onednn'] / best['kvstrata']:5.2f}x",
                  flush=True)
    return out


def _time(layer, x) -> float:
    t = time.perf_counter()
    layer(x)
    return time.perf_counter() - t


def decode_steps(args, dtype: torch.dtype) -> list[dict]:
    """Per batch size: ms per decode step ((time of --tokens tokens - time of 1) / the rest)
    and of the prefill + first token (batch x 32-token prompts), two engines alternated."""
    from kvstrata.bench.engine_ab import engines_by_setting, generate_times
    out = []
    quant = "w8a8_int8" if args.kind == "int8" else None
    with engines_by_setting(KINDS[args.kind][0], {"kvstrata": "auto", "onednn": "onednn"},
                            model_path=args.model, dtype=str(dtype).removeprefix("torch."),
                            quantization=quant, max_total_tokens=8192,
                            disable_radix_cache=True) as engines:
        for b in args.batches:
            runs = generate_times(engines, b, args.tokens, args.rounds)
            step = {v: (r[args.tokens] - r[1]) / (args.tokens - 1) for v, r in runs.items()}
            row = {"batch": b, "step_ms": step["kvstrata"] * 1e3,
                   "baseline_step_ms": step["onednn"] * 1e3,
                   "step_speedup": step["onednn"] / step["kvstrata"],
                   "first_ms": runs["kvstrata"][1] * 1e3,
                   "baseline_first_ms": runs["onednn"][1] * 1e3,
                   "first_speedup": runs["onednn"][1] / runs["kvstrata"][1]}
            out.append(row)
            print(f"batch {b:3d}: decode step {row['step_ms']:6.1f} vs "
                  f"{row['baseline_step_ms']:6.1f} ms ({row['step_speedup']:.2f}x); "
                  "prefill + first token "
                  f"{row['first_ms']:7.1f} vs {row['baseline_first_ms']:7.1f} ms "
                  f"({row['first_speedup']:.2f}x)", flush=True)
    return out


if __name__ == "__main__":
    main()
