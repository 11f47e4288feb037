"""The CPU paged decode attention kernel alone, per instruction set, against a copy of the
bytes it must read (measured in the same run): one decode layer of SmolLM2 (9 query heads,
3 KV heads of 64) at batch 32 over 16-token pages scattered in a pool, per pool dtype.
Instruction sets are capped with KVSTRATA_CPU_ISA (a cap above what the CPU has runs the
widest it has; the row names the one that ran). Interleaved rounds: a noisy box hits every
variant alike.

`--query-dtype pool` gives the query the pool's dtype, as a model's is (a bf16 query over a
bf16 pool takes the AVX512-BF16 path); `--layers 30` reads 30 layers' pools a call, one after
the other, as a decode step does, so the rows come from RAM rather than the L3 cache that
holds one layer (SmolLM2, 190 tokens, Zen 4 EPYC: ~8 ms for 30 layers from RAM, ~4 ms from
L3).

  python benchmarks/bench_paged_decode.py --batch 32 --context 190 --pool-pages 4096
  python benchmarks/bench_paged_decode.py --dtypes bfloat16 --isas avx512 --query-dtype pool \
      --layers 30 --pool-pages 400
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.runner.attention.paged_decode import kernel_isa, paged_decode  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _case(batch: int, context: int, pool_pages: int, hq: int, hkv: int, d: int, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages_each = -(-context // 16)
    if pool_pages < batch * pages_each:
        raise ValueError(f"--pool-pages {pool_pages} < the {batch * pages_each} pages needed")
    k = torch.randn(pool_pages * 16, hkv, d, generator=g).to(dtype)
    v = torch.randn(pool_pages * 16, hkv, d, generator=g).to(dtype)
    pages = torch.randperm(pool_pages, generator=g)[:batch * pages_each].view(batch, -1)
    slots = (pages[:, :, None] * 16 + torch.arange(16)).reshape(batch, -1)[:, :context]
    starts = torch.arange(batch + 1, dtype=torch.int64) * context
    q = torch.randn(batch, hq, d, generator=g)
    return q, k, v, slots.reshape(-1).contiguous(), starts


def _layers(args, hq: int, hkv: int, d: int, dtype) -> list[tuple]:
    """One (q, k, v, slots, starts) per layer (pages shuffled anew in each)."""
    cases = []
    for layer in range(args.layers):
        q, k, v, slots, starts = _case(args.batch, args.context, args.pool_pages, hq, hkv, d,
                                       dtype, seed=layer)
        cases.append((q.to(dtype) if args.query_dtype == "pool" else q, k, v, slots, starts))
    return cases


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=190)
    p.add_argument("--pool-pages", type=int, default=4096)
    p.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("HQ", "HKV", "D"))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--isas", nargs="+", default=["scalar", "avx2", "avx512"])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--query-dtype", choices=["float32", "pool"], default="float32",
                   help="pool: the query in the pool's dtype, as a model's")
    p.add_argument("--layers", type=int, default=1,
                   help="layers' pools read per timed call (30: a decode step's KV, from RAM)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    hq, hkv, d = args.heads
    rows = []
    for name in args.dtypes:
        cases = _layers(args, hq, hkv, d, DTYPES[name])
        k, slots = cases[0][1], cases[0][3]
        nbytes = slots.numel() * hkv * d * k.element_size() * 2 * len(cases)  # K, V rows
        src = torch.randn(nbytes // 4)
        dst = torch.empty_like(src)
        times = {isa: [] for isa in args.isas}
        copies = []
        saved = os.environ.get("KVSTRATA_CPU_ISA")
        ran = {}
        try:
            for _ in range(args.rounds):
                copies.append(_timed(lambda: dst.copy_(src)))
                for isa in args.isas:
                    os.environ["KVSTRATA_CPU_ISA"] = isa
                    ran[isa] = kernel_isa(d, DTYPES[name])
                    times[isa].append(_timed(
                        lambda: [paged_decode(*case, d ** -0.5) for case in cases]))
        finally:
            if saved is None:
                os.environ.pop("KVSTRATA_CPU_ISA", None)
            else:
                os.environ["KVSTRATA_CPU_ISA"] = saved
        copy_s = statistics.median(copies)
        for isa in args.isas:
            s = statistics.median(times[isa])
            rows.append({"dtype": name, "cap": isa, "ran": ran[isa], "us": s * 1e6,
                         "gb_s": nbytes / s / 1e9, "copy_us": copy_s * 1e6,
                         "vs_copy": s / copy_s})
            print(f"{name:9s} cap {isa:7s} ran {ran[isa]:7s} {s * 1e6:8.1f} us "
                  f"{nbytes / s / 1e9:6.1f} GB/s  {s / copy_s:5.2f}x a copy of its bytes "
                  f"({copy_s * 1e6:.1f} us)")
    result = {"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
