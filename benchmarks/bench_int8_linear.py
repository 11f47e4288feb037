"""Int8 linear kernels on CPU vs float32 nn.Linear, at SmolLM2-135M shapes, in one run.

Candidates (each timed interleaved with float32 on the same input; the machine is shared, so
a float32 time from another minute is not comparable):
  kvstrata    what --quantization w8a8_int8 runs on this CPU (quantization.int8_kernel): with
              VNNI runner/int8_linear.Int8MatmulLinear (oneDNN's prepacked int8 linear,
              per-token scales), else the fbgemm layer below
  kvstrata_fbgemm  runner/quant/w8a8.W8A8Int8Linear: fbgemm, per-token activation scales
              (the layer without VNNI, or with KVSTRATA_CPU_INT8_MM=0)
  fbgemm_dyn  torch.ops.quantized.linear_dynamic: fbgemm, ONE activation scale per call
              (torch.ao quantize_dynamic's op; its result depends on the other rows)
  torchao     torchao.quantization Int8DynamicActivationInt8WeightConfig (if torchao is
              importable): its CPU path is torch._int_mm
`ratio` = float32 time / candidate time (> 1: the candidate is faster), median of the paired
ratios; `error` = max |candidate - float32| / max |float32| on that input.

  python benchmarks/bench_int8_linear.py --threads 1 --out benchmarks/results/int8_linear.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import warnings

import torch

warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")  # torch's deprecation
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402
from kvstrata.runner.quant.w8a8 import (W8A8Int8Linear, int8_kernel,  # noqa: E402
                                        quantized_linear)

SHAPES = ((576, 1536), (1536, 576), (576, 49152))  # in -> out: qkv-ish/up, down, lm_head
ROWS = (1, 32, 2048)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--shapes", nargs="+", default=[f"{k}:{n}" for k, n in SHAPES],
                   help="in:out features of the weights (default: SmolLM2's)")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    p.add_argument("--torchao-max-flops", type=float, default=2e10,
                   help="skip torchao above this many FLOPs per call (it is very slow)")
    p.add_argument("--out", default="benchmarks/results/int8_linear.json")
    add_quiet_arg(p)
    return p.parse_args(argv)


def _time(fn, x, min_time: float) -> float:
    fn(x)  # warm-up (packing caches, allocator)
    n, start = 0, time.perf_counter()
    while True:
        fn(x)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / n


def _torchao_linear(weight: torch.Tensor):
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError as exc:
        return None, f"torchao not importable: {exc}"
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight.data.copy_(weight)
    model = torch.nn.Sequential(lin)
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    return model, None


def candidates(weight: torch.Tensor, rows: int, args) -> dict:
    packed = torch.ops.quantized.linear_prepack(
        torch.quantize_per_channel(weight, weight.abs().amax(1).double() / 127,
                                   torch.zeros(weight.shape[0], dtype=torch.int64), 0,
                                   torch.qint8), None)
    ours, fbgemm_rows = int8_kernel()[0](weight), W8A8Int8Linear(weight)
    out = {"kvstrata": lambda x: quantized_linear(x, ours),  # as the decoder calls it
           "kvstrata_fbgemm": lambda x: quantized_linear(x, fbgemm_rows),
           "fbgemm_dyn": lambda x: torch.ops.quantized.linear_dynamic(x, packed, False)}
    flops = 2 * rows * weight.shape[0] * weight.shape[1]
    if flops > args.torchao_max_flops:
        out["torchao"] = f"skipped: {flops:.1e} FLOPs > --torchao-max-flops"
    else:
        model, why = _torchao_linear(weight)
        out["torchao"] = model if model is not None else why
    return out


def measure(k: int, n: int, rows: int, args) -> list[dict]:
    torch.manual_seed(0)
    weight = torch.randn(n, k) * k ** -0.5
    x = torch.randn(rows, k)
    x[:, :4] *= 8  # a few outlier channels, as in real activations
    ref = torch.nn.Linear(k, n, bias=False)
    ref.weight.data.copy_(weight)
    results = []
    with torch.inference_mode():
        expected = ref(x)
        for name, fn in candidates(weight, rows, args).items():
            row = {"kernel": name, "k": k, "n": n, "rows": rows}
            if isinstance(fn, str):
                results.append({**row, "skipped": fn})
                continue
            ratios, fp32_times, times = [], [], []
            for _ in range(3):
                t_ref, t = _time(ref, x, args.min_time), _time(fn, x, args.min_time)
                fp32_times.append(t_ref)
                times.append(t)
                ratios.append(t_ref / t)
            err = (fn(x) - expected).abs().max().item() / expected.abs().max().item()
            results.append({**row, "fp32_ms": min(fp32_times) * 1e3, "ms": min(times) * 1e3,
                            "ratio": statistics.median(ratios), "error": err})
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = announce_load(args.require_quiet)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    rows_out = []
    for k, n in (tuple(int(v) for v in shape.split(":")) for shape in args.shapes):
        for rows in args.rows:
            for r in measure(k, n, rows, args):
                rows_out.append(r)
                shape = f"M={rows:<5d} {k:>5d} -> {n:<6d}"
                if "skipped" in r:
                    print(f"{shape} {r['kernel']:<11s} {r['skipped']}")
                else:
                    print(f"{shape} {r['kernel']:<11s} fp32 {r['fp32_ms']:9.3f} ms  int8 "
                          f"{r['ms']:9.3f} ms  ratio {r['ratio']:6.2f}x  error "
                          f"{r['error']:.4f}", flush=True)
    report = {"torch": torch.__version__, "threads": args.threads, "box_load": load,
              "results": rows_out}
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
