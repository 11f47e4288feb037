"""All-reduce micro-benchmark for tensor parallelism: `size` processes on this machine (one
core each, as `serve --tp-size` pins them) all-reduce hidden-size vectors at batch 1 and 32,
the shapes one decode step reduces twice per layer, through gloo and through kvstrata's
shared-memory all-reduce (runner/parallel/shm_allreduce.py). Reported against a baseline
measured in the same run: a copy of the same buffer in one process (memcpy), so the ratios
hold across noisy machines; the per-step figure multiplies by the model's reduce count.

    kvstrata bench allreduce                      # 2 ranks, SmolLM2's hidden size 576
    kvstrata bench allreduce --size 3 --hidden 576 --layers 30
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

from kvstrata.bench.ports import free_port

BATCHES = (1, 32)
DTYPES = ("float32", "bfloat16")


def _time_calls(fn, iters: int) -> float:
    """Median seconds of one call over `iters` calls (after 10 warm-up calls)."""
    for _ in range(10):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _rank(rank: int, size: int, port: int, hidden: int, iters: int, out) -> None:
    import torch
    import torch.distributed as dist

    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, [cores[rank % len(cores)]])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    from kvstrata.runner.parallel.tp_comm import open_shm

    shm = open_shm(rank, size)
    try:
        for dtype in DTYPES:
            for batch in BATCHES:
                t = torch.randn(batch, hidden).to(getattr(torch, dtype))
                seconds = _time_calls(lambda: dist.all_reduce(t), iters)
                dist.barrier()
                shm_seconds = _time_calls(lambda: shm.all_reduce(t), iters)
                dist.barrier()
                if rank == 0:
                    copy = torch.empty_like(t)
                    base = _time_calls(lambda: copy.copy_(t), iters)
                    out.put((dtype, batch, seconds, shm_seconds, base))
    finally:
        dist.destroy_process_group()


def run(size: int = 2, hidden: int = 576, layers: int = 30, iters: int = 300) -> dict:
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, size, port, hidden, iters, out))
             for r in range(size)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=300) for _ in range(len(DTYPES) * len(BATCHES))]
    for p in procs:
        p.join(60)
    reduces = 2 * layers + 1  # o_proj and down per layer, the embedding (logits: a gather)
    result = {"size": size, "hidden": hidden, "reduces_per_step": reduces, "rows": []}
    print(f"all-reduce over {size} gloo ranks, hidden {hidden} ({reduces} reduces / step)")
    print(f"{'dtype':>9} {'batch':>5} {'memcpy us':>10} {'gloo us':>8} {'x memcpy':>9} "
          f"{'shm us':>7} {'x memcpy':>9} {'gloo/shm':>9} {'step ms gloo':>13} "
          f"{'step ms shm':>12}")
    for dtype, batch, seconds, shm_seconds, base in rows:
        row = {"dtype": dtype, "batch": batch, "memcpy_us": base * 1e6,
               "gloo_us": seconds * 1e6, "gloo_vs_memcpy": seconds / base,
               "shm_us": shm_seconds * 1e6, "shm_vs_memcpy": shm_seconds / base,
               "gloo_vs_shm": seconds / shm_seconds,
               "per_step_ms_gloo": seconds * reduces * 1e3,
               "per_step_ms_shm": shm_seconds * reduces * 1e3}
        result["rows"].append(row)
        print(f"{dtype:>9} {batch:>5} {row['memcpy_us']:10.2f} {row['gloo_us']:8.1f} "
              f"{row['gloo_vs_memcpy']:9.0f} {row['shm_us']:7.1f} {row['shm_vs_memcpy']:9.1f} "
              f"{row['gloo_vs_shm']:9.1f} {row['per_step_ms_gloo']:13.2f} "
              f"{row['per_step_ms_shm']:12.2f}")
    return result


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--size", type=int, default=2, help="ranks (processes)")
    ap.add_argument("--hidden", type=int, default=576, help="vector width (SmolLM2: 576)")
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2: 30)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--output-json", default="benchmarks/results/allreduce.json")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="kvstrata bench allreduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    args = ap.parse_args(argv)
    result = run(args.size, args.hidden, args.layers, args.iters)
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
