"""The two attention orders deterministic inference can run, attention alone, in CPU time at
one thread (robust on a busy box): the prefill kernel's order (torch_native.py `fixed_order`:
prompts in the prefill kernel, decode rows as one-row prompts of it, paged_decode `fixed`)
against the paged decode kernel's (every query over its own keys: KVSTRATA_CPU_DETERMINISTIC_
BLOCKS=0), on SmolLM2's 9 / 3 heads of 64 over rows shuffled in a pool, per dtype:
  prefill  B prompts of L tokens, cold: one prefill_attention call vs one ranged decode call;
  decode   B rows at C keys of context: the decode kernel vs its `fixed` order.
Reported as per-call CPU ms (median of the repeats) and the ratio decode-order / fixed-order
(> 1: the prefill kernel's order is faster).

  python benchmarks/bench_deterministic_attention.py
  python benchmarks/bench_deterministic_attention.py --dtypes bfloat16 --output-json a.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402
from kvstrata.runner.attention.paged_decode import (paged_decode, prefill_attention,  # noqa: E402
                                                    prefill_seqs)

PREFILLS = ((32, 128), (8, 512), (1, 2000))   # (prompts, tokens)
DECODES = ((1, 160), (32, 160), (8, 512))     # (rows, keys of context)


def cpu_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return sorted(times)[len(times) // 2] * 1e3


def run(dtype: torch.dtype, pool_rows: int, hq: int = 9, hkv: int = 3, d: int = 64) -> list:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(pool_rows, hkv, d, generator=g).to(dtype)
    v = torch.randn(pool_rows, hkv, d, generator=g).to(dtype)
    scale, rows = d ** -0.5, []
    for b, n in PREFILLS:
        slots = torch.randperm(pool_rows, generator=g)[:b * n]
        q = torch.randn(b * n, hq, d, generator=g).to(dtype)
        seqs = prefill_seqs([(i * n, (i + 1) * n, i * n, 0) for i in range(b)])
        starts = torch.arange(b).repeat_interleave(n) * n
        ends = starts + torch.arange(n).repeat(b) + 1
        fixed = cpu_ms(lambda: prefill_attention(q, k, v, slots, seqs, scale), 5)
        per_token = cpu_ms(lambda: paged_decode(q, k, v, slots, starts, scale, ends=ends), 5)
        rows.append(("prefill", b, n, per_token, fixed))
    for b, c in DECODES:
        slots = torch.randperm(pool_rows, generator=g)[:b * c]
        q = torch.randn(b, hq, d, generator=g).to(dtype)
        starts = torch.arange(0, b * c + 1, c)
        per_token = cpu_ms(lambda: paged_decode(q, k, v, slots, starts, scale), 200)
        fixed = cpu_ms(lambda: paged_decode(q, k, v, slots, starts, scale, fixed=True), 200)
        rows.append(("decode", b, c, per_token, fixed))
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                   choices=["bfloat16", "float32"])
    p.add_argument("--pool-rows", type=int, default=20000)
    p.add_argument("--output-json", default=None)
    add_quiet_arg(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = {"args": vars(args), "load": announce_load(args.require_quiet), "rows": []}
    for name in args.dtypes:
        for kind, b, n, per_token, fixed in run(getattr(torch, name), args.pool_rows):
            print(f"{name} {kind} {b} x {n}: decode kernel's order {per_token:.3f} ms, prefill "
                  f"kernel's order {fixed:.3f} ms ({per_token / fixed:.2f}x)", flush=True)
            result["rows"].append({"dtype": name, "kind": kind, "batch": b, "tokens": n,
                                   "decode_order_ms": per_token, "fixed_order_ms": fixed})
    if args.output_json:
        write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
