"""The CPU prefill attention kernel alone, per instruction set, against torch's SDPA (flash
attention on CPU) on the same values, measured in the same run: one causal layer of SmolLM2
(9 query heads, 3 KV heads of 64) per prompt length and dtype. The kernel reads the keys
from scattered rows of a pool, as in serving; SDPA gets them contiguous (its best case).
Instruction sets are capped with KVSTRATA_CPU_ISA (a cap above what the CPU has runs the
widest it has; the row names the one that ran). Interleaved rounds, best of each: a noisy
box hits every variant alike. Useful GFLOP/s count the causal half only (2 * T^2 * D * Hq).

With --model, whole prefills too: two engines of that model in this process, one with the
kernel and one with KVSTRATA_CPU_PREFILL_ATTENTION=0 (SDPA), each --prompts wave (COUNTxLEN
random token prompts, one token generated, no prefix cache) alternated between them.

  python benchmarks/bench_prefill_attention.py --lengths 128 512 2048
  python benchmarks/bench_prefill_attention.py --lengths --model smollm2-135m \
      --prompts 1x2048 1x512 32x128
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.engine_ab import engines_by_setting  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402
from kvstrata.runner.attention.paged_decode import (prefill_attention,  # noqa: E402
                                                     prefill_kernel_isa, prefill_seqs)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _case(n: int, hq: int, hkv: int, d: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    v = torch.randn(n, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(2 * n, generator=g)[:n]
    k_pool = torch.zeros(2 * n, hkv, d, dtype=dtype)
    v_pool = torch.zeros(2 * n, hkv, d, dtype=dtype)
    k_pool[slots], v_pool[slots] = k, v
    return q, k, v, k_pool, v_pool, slots


def _mean_time(fn, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="*", default=[128, 512, 2048])
    p.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("HQ", "HKV", "D"))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--isas", nargs="+", default=["avx2", "avx512"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default=None, help="also time whole prefills of this model")
    p.add_argument("--model-dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--prompts", nargs="+", default=["1x2048", "1x512", "32x128"],
                   help="waves COUNTxLEN for --model")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    hq, hkv, d = args.heads
    rows = []
    for name in args.dtypes:
        for n in args.lengths:
            q, k, v, k_pool, v_pool, slots = _case(n, hq, hkv, d, DTYPES[name])
            seqs = prefill_seqs([(0, n, 0, 0)])
            qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
            want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                  enable_gqa=True)[0].transpose(0, 1)
            flops = 2 * n * n * d * hq
            reps = max(1, int(2e8 / flops))
            best = {"sdpa": float("inf"), **{isa: float("inf") for isa in args.isas}}
            ran, err = {}, {}
            for _ in range(args.rounds):
                best["sdpa"] = min(best["sdpa"], _mean_time(lambda: F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, enable_gqa=True), reps))
                for isa in args.isas:
                    with mock.patch.dict(os.environ, {"KVSTRATA_CPU_ISA": isa}):
                        ran[isa] = prefill_kernel_isa(d)
                        out = prefill_attention(q, k_pool, v_pool, slots, seqs, d ** -0.5)
                        err[isa] = (out.float() - want.float()).abs().max().item()
                        best[isa] = min(best[isa], _mean_time(lambda: prefill_attention(
                            q, k_pool, v_pool, slots, seqs, d ** -0.5, out=out), reps))
            for isa in args.isas:
                s, base = best[isa], best["sdpa"]
                rows.append({"dtype": name, "tokens": n, "cap": isa, "ran": ran[isa],
                             "ms": s * 1e3, "sdpa_ms": base * 1e3, "gflops": flops / s / 1e9,
                             "sdpa_gflops": flops / base / 1e9, "vs_sdpa": base / s,
                             "max_abs_err": err[isa]})
                print(f"{name:9s} {n:5d} tokens cap {isa:7s} ran {ran[isa]:7s} "
                      f"{s * 1e3:8.3f} ms {flops / s / 1e9:6.1f} GFLOP/s | SDPA "
                      f"{base * 1e3:8.3f} ms {flops / base / 1e9:6.1f} GFLOP/s | "
                      f"{base / s:4.2f}x SDPA, max |diff| {err[isa]:.1e}")
    result = {"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}
    if args.model:
        result["prefills"] = whole_prefills(args)
    if args.out:
        write_json(args.out, result)
    return result


def whole_prefills(args) -> list[dict]:
    waves = []
    for spec in args.prompts:
        count, _, length = spec.partition("x")
        if not (count.isdigit() and length.isdigit()):
            raise ValueError(f"--prompts {spec!r}: expected COUNTxLEN, e.g. 32x128")
        waves.append((spec, int(count), int(length)))
    g = torch.Generator().manual_seed(1)
    greedy = {"max_new_tokens": 1, "temperature": 0.0}
    out = []
    with engines_by_setting("KVSTRATA_CPU_PREFILL_ATTENTION", {"kernel": "1", "sdpa": "0"},
                            model_path=args.model, dtype=args.model_dtype,
                            max_total_tokens=max(c * n for _, c, n in waves) + 64,
                            disable_radix_cache=True) as engines:
        for spec, count, length in waves:
            ids = torch.randint(100, 20000, (count, length), generator=g).tolist()
            best = {v: float("inf") for v in engines}
            for _ in range(args.rounds):
                for variant, llm in engines.items():
                    t = time.perf_counter()
                    llm.generate(input_ids=ids, sampling_params=greedy)
                    best[variant] = min(best[variant], time.perf_counter() - t)
            out.append({"wave": spec, "kernel_s": best["kernel"], "sdpa_s": best["sdpa"],
                        "speedup": best["sdpa"] / best["kernel"]})
            print(f"prefill {spec:>8s} ({args.model_dtype}): kernel {best['kernel']:.3f} s, "
                  f"SDPA {best['sdpa']:.3f} s: {best['sdpa'] / best['kernel']:.2f}x")
    return out


if __name__ == "__main__":
    main()
