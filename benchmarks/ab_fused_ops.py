"""A/B of the decode step's fused CPU paths in one process: the rotary embedding in place
(cpu_ops.rope_), the residual add fused into the next norm (cpu_ops.add_rms_norm) and the
paged kernel reading a bf16 query (no fp32 copy in, no bf16 copy out), against the torch ops
they replaced; `--paths` picks which (`norm`: cpu_ops.rms_norm too, e.g. the fp32 rows).
The decode plan (runner/models/decode_plan.py) replays those calls without their wrappers, so
it is off in both variants unless `--paths plan`: then the A/B is of the plan alone (the
fused ops on in both, the plan on in one), e.g. `--paths plan --dtype float32 --batch 1`.
Both variants run interleaved, round after round, on the same DecodeBatch
(benchmarks/bench_decode_step.py), so a noisy box hits both alike; the report is the ratio.

  python benchmarks/ab_fused_ops.py --dtype bfloat16 --batch 32 --context 128
  python benchmarks/ab_fused_ops.py --dtype float32 --paths norm add_norm --batch 1 --context 192
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_decode_step as step_bench  # noqa: E402
from kvstrata.config.kv_plan import KVPlan  # noqa: E402
from kvstrata.runner.cpu import fused_ops as cpu_ops  # noqa: E402
from kvstrata.runner.attention import paged_decode  # noqa: E402
from kvstrata.runner.model_runner import ModelRunner  # noqa: E402
from kvstrata.runner.models import decode_plan  # noqa: E402

FUSED = {"rope": cpu_ops.rope_, "add_norm": cpu_ops.add_rms_norm, "norm": cpu_ops.rms_norm,
         "bf16_query": paged_decode.Q_DTYPES, "plan": decode_plan.enabled}
DEFAULT_PATHS = ("rope", "add_norm", "bf16_query")
DECLINED = {"rope": lambda *args, **kwargs: False, "add_norm": lambda *args, **kwargs: None,
            "norm": lambda *args, **kwargs: None, "bf16_query": {torch.float32: 0},
            "plan": lambda: False}


def use_fused(on: bool, paths=DEFAULT_PATHS) -> None:
    """Off: the fused calls of `paths` decline, so the decoder and the attention backend take
    their torch-op fallbacks (the code paths before the fusion)."""
    chosen = {name: FUSED[name] if on or name not in paths else DECLINED[name]
              for name in FUSED}
    cpu_ops.rope_, cpu_ops.add_rms_norm = chosen["rope"], chosen["add_norm"]
    cpu_ops.rms_norm, paged_decode.Q_DTYPES = chosen["norm"], chosen["bf16_query"]
    # the plan bypasses the wrappers above: on only in the "on" variant of its own A/B
    decode_plan.enabled = FUSED["plan"] if on and "plan" in paths else DECLINED["plan"]


def restore() -> None:
    """Every path as it was before the A/B (the plan on)."""
    use_fused(True, list(FUSED))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=[None, "w8a8_int8"],
                   help="int8 linear layers (the plan runs them as the model's own call)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    p.add_argument("--paths", nargs="+", choices=sorted(FUSED), default=list(DEFAULT_PATHS),
                   help="the fused paths the 'torch ops' variant turns off")
    args = p.parse_args(argv)
    runner = ModelRunner(args.model, dtype=args.dtype, device="cpu",
                         quantization=args.quantization)
    d = runner.model.dims
    pages = args.batch * (args.context // step_bench.PAGE + 1) + 2
    runner.allocate_kv(KVPlan.mha(num_layers=d.num_layers, num_kv_heads=d.num_kv_heads,
                                  head_dim=d.head_dim, dtype=args.dtype,
                                  page_size=step_bench.PAGE, num_pages=pages,
                                  num_rows=args.batch + 1, context_len=args.context + 1))
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        with torch.inference_mode():
            batch = step_bench.DecodeBatch(runner, args.batch, args.context, 1, 1)
            for _ in range(args.rounds):
                for on in (False, True):
                    use_fused(on, args.paths)
                    batch.step()  # warm-up of this variant
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        batch.step()
                    times[on].append((time.perf_counter() - start) / args.steps * 1e3)
    finally:
        restore()
        runner.shutdown()
    old, new = statistics.median(times[False]), statistics.median(times[True])
    off_name, on_name = ("layer loop", "plan") if args.paths == ["plan"] else ("torch ops",
                                                                               "fused")
    quant = f" {args.quantization}" if args.quantization else ""
    print(f"{args.dtype}{quant} B={args.batch} C={args.context} {'+'.join(args.paths)}: {off_name} "
          f"{old:.2f} ms, {on_name} {new:.2f} ms per step -> {old / new:.3f}x", flush=True)
    return {"dtype": args.dtype, "quantization": args.quantization, "batch": args.batch,
            "context": args.context, "paths": list(args.paths),
            "torch_ops_ms": old, "fused_ms": new, "speedup": old / new}


if __name__ == "__main__":
    main()
