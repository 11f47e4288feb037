"""Decode retraction with KV backup: time to back up and restore one request's KV, per
backend (cpu_tensor; host_pool in every allowed layout x IO pair), against recomputing it
(the forward of the same prompt's prefill, measured in the same run).

A decode server cannot recompute a prompt it never ran, but the comparison says what a
backup buys over SGLang's non-PD retraction (drop the KV, prefill again). Default geometry:
SmolLM2-135M (30 layers, 3 KV heads x 64, fp32), page 16, a 2k-token request. Device page
ids are random in a pool 4x the request (a fragmented pool); each repetition backs up into
fresh random pages and restores into other random pages, as the scheduler would.

With --serve it also runs the same load through real PD servers (tcp) with a decode pool
too small for the batch, per backend, beside one that never retracts: output tok/s of the
whole run (kvstrata/bench/retraction_serve.py).

Targets (issue 11): a restore from the host >= 5x faster than recomputing; host_pool restore
within 1.5x of cpu_tensor.

  python benchmarks/bench_retraction.py --out benchmarks/results/bench_retraction.json

A cpu_tensor backup allocates a fresh tensor per request: its first touch (page faults,
~40 ms for 94 MB here) dominates the backup, and freeing it adds ~5 ms to the restore; the
host pool is touched once at start-up. On a busy 2-core box `direct` (one torch copy_ per
page run) can collapse with 2 intra-op threads (OpenMP workers fighting other processes):
compare with --threads 1.
"""
from __future__ import annotations

import argparse
import json
import os
import platform as stdlib_platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.bench.retraction_serve import add_serve_args, whole_run  # noqa: E402
from kvstrata.config.kv_plan import IO_BACKEND_LAYOUTS, KVPlan  # noqa: E402
from kvstrata.kv.device_pool import MHATokenToKVPool  # noqa: E402
from kvstrata.kv.host_pool import HostKVPool  # noqa: E402
from kvstrata.kv.io_backends import make_io_backend  # noqa: E402
from kvstrata.protocol.disagg import BackupOp  # noqa: E402
from kvstrata.runner.executors.retraction_backup import RetractionBackupExecutor  # noqa: E402

RESTORE_VS_RECOMPUTE_MIN = 5.0
HOST_VS_CPU_TENSOR_MAX = 1.5
# The default geometry: SmolLM2-135M's KV, pages of 16 tokens.
SMOLLM2_GEOMETRY = {"layers": 30, "kv_heads": 3, "head_dim": 64, "page_size": 16}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in SMOLLM2_GEOMETRY.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--tokens", type=int, default=2048, help="KV tokens of the request")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--model", default="smollm2-135m",
                   help="model whose prefill of --tokens tokens is the recompute baseline")
    p.add_argument("--recompute-reps", type=int, default=2)
    p.add_argument("--skip-recompute", action="store_true")
    p.add_argument("--out", default="benchmarks/results/bench_retraction.json")
    add_quiet_arg(p)
    add_serve_args(p)
    return p.parse_args()


def variants():
    yield "cpu_tensor", None, None
    for io, layouts in IO_BACKEND_LAYOUTS.items():
        for layout in layouts:
            yield "host_pool", io, layout


def time_backend(pool, backend, io, layout, n_pages, tokens, reps, gen) -> dict:
    host_ids = []
    if backend == "cpu_tensor":
        ex = RetractionBackupExecutor(pool)
    else:
        host = HostKVPool(pool.geom, 2 * n_pages, layout)
        ex = RetractionBackupExecutor(pool, host, make_io_backend(io, pool.kv, host))
        host_ids = (torch.randperm(2 * n_pages, generator=gen)[:n_pages] + 1).tolist()
    backups, restores = [], []
    for rep in range(reps + 1):  # the first is a warm-up
        src = (torch.randperm(pool.plan.num_pages, generator=gen)[:n_pages] + 1).tolist()
        dst = (torch.randperm(pool.plan.num_pages, generator=gen)[:n_pages] + 1).tolist()
        start = time.perf_counter()
        ex.apply([BackupOp("backup", "r", backend, tokens, src, host_ids)])
        mid = time.perf_counter()
        ex.apply([BackupOp("restore", "r", backend, tokens, dst, host_ids)])
        end = time.perf_counter()
        if rep:
            backups.append(mid - start)
            restores.append(end - mid)
    nbytes = n_pages * pool.geom.bytes_per_page
    return dict(backend=backend, io=io, layout=layout, bytes=nbytes,
                backup_s=min(backups), backup_median_s=statistics.median(backups),
                restore_s=min(restores), restore_median_s=statistics.median(restores),
                backup_gbps=nbytes / min(backups) / 1e9,
                restore_gbps=nbytes / min(restores) / 1e9)


def time_recompute(model: str, tokens: int, reps: int, geometry: dict) -> dict:
    """Best wall time of a `tokens`-token prefill forward (with sampling) of `model`."""
    from kvstrata.protocol.sampling_params import SamplingParams
    from kvstrata.protocol.scheduler_output import (NewRequestData, ScheduledRequest,
                                                    SchedulerOutput)
    from kvstrata.runner.model_runner import ModelRunner

    r = ModelRunner(model, dtype="float32", device="cpu")
    d = r.model.dims
    page = geometry["page_size"]
    r.allocate_kv(KVPlan.mha(num_layers=d.num_layers, num_kv_heads=d.num_kv_heads,
                             head_dim=d.head_dim, dtype="float32", page_size=page,
                             num_pages=-(-tokens // page) + 1, num_rows=2,
                             context_len=tokens + page))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, r.vocab_size, (tokens,), generator=gen).tolist()
    slots = list(range(page, page + tokens))  # pages 1.. in order
    times = []
    for rep in range(reps):
        rid = f"p{rep}"
        sched = SchedulerOutput(rep, True, [NewRequestData(rid, prompt, [], SamplingParams(
            temperature=0.0, max_new_tokens=1))], [ScheduledRequest(rid, 1, 0, prompt, 0, slots,
                                                                   True)], [])
        start = time.perf_counter()
        r.execute(sched)
        times.append(time.perf_counter() - start)
        r.execute(SchedulerOutput(rep, False, [], [], [rid]))
    r.shutdown()
    model_geometry = dict(layers=d.num_layers, kv_heads=d.num_kv_heads, head_dim=d.head_dim)
    return dict(model=model, recompute_s=min(times), times_s=times,
                model_geometry=model_geometry,
                same_geometry=all(geometry[k] == v for k, v in model_geometry.items()))


def main() -> None:
    args = parse_args()
    box = announce_load(args.require_quiet)
    if args.threads:
        torch.set_num_threads(args.threads)
    n_pages = -(-args.tokens // args.page_size)
    plan = KVPlan.mha(num_layers=args.layers, num_kv_heads=args.kv_heads,
                      head_dim=args.head_dim, dtype=args.dtype, page_size=args.page_size,
                      num_pages=4 * n_pages)
    pool = MHATokenToKVPool(plan, "cpu")
    gen = torch.Generator().manual_seed(0)
    pool.kv.view(torch.uint8).random_(generator=gen)  # touch every page, any bits
    geometry = dict(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                    page_size=args.page_size, dtype=args.dtype, tokens=args.tokens,
                    pages=n_pages, bytes=n_pages * pool.geom.bytes_per_page)
    print(f"{args.tokens} tokens = {n_pages} pages of {args.page_size} = "
          f"{geometry['bytes'] / 1e6:.1f} MB; threads {torch.get_num_threads()}", flush=True)
    rows = [time_backend(pool, b, io, layout, n_pages, args.tokens, args.reps, gen)
            for b, io, layout in variants()]
    del pool
    recompute = None
    if not args.skip_recompute:
        recompute = time_recompute(args.model, args.tokens, args.recompute_reps, geometry)
        if not recompute["same_geometry"]:
            print(f"note: {args.model} geometry {recompute['model_geometry']} differs from the "
                  f"backup geometry", flush=True)
    cpu_restore = rows[0]["restore_s"]
    checks = []
    for row in rows:
        row["restore_vs_cpu_tensor"] = row["restore_s"] / cpu_restore
        if recompute:
            row["recompute_over_restore"] = recompute["recompute_s"] / row["restore_s"]
            row["recompute_over_backup_restore"] = recompute["recompute_s"] / (
                row["restore_s"] + row["backup_s"])
        name = row["backend"] + (f" {row['io']}/{row['layout']}" if row["io"] else "")
        line = (f"{name:32s} backup {row['backup_s'] * 1e3:7.2f} ms "
                f"({row['backup_gbps']:5.2f} GB/s)  restore {row['restore_s'] * 1e3:7.2f} ms "
                f"({row['restore_gbps']:5.2f} GB/s)  restore/cpu_tensor "
                f"{row['restore_vs_cpu_tensor']:.2f}")
        if recompute:
            line += f"  recompute/restore {row['recompute_over_restore']:.1f}x"
        print(line, flush=True)
        if row["backend"] == "host_pool":
            checks.append(dict(what=f"{name}: restore within {HOST_VS_CPU_TENSOR_MAX}x of "
                               f"cpu_tensor", ok=row["restore_vs_cpu_tensor"]
                               <= HOST_VS_CPU_TENSOR_MAX))
            if recompute:
                checks.append(dict(what=f"{name}: restore >= {RESTORE_VS_RECOMPUTE_MIN}x "
                                   f"faster than recompute", ok=row["recompute_over_restore"]
                                   >= RESTORE_VS_RECOMPUTE_MIN))
    if recompute:
        print(f"recompute ({args.model} prefill of {args.tokens} tokens): "
              f"{recompute['recompute_s'] * 1e3:.1f} ms", flush=True)
    for c in checks:
        print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['what']}")
    serve = whole_run(args) if args.serve else None
    meta = dict(geometry=geometry, reps=args.reps, threads=torch.get_num_threads(),
                box_load=box, torch=torch.__version__,
                machine=stdlib_platform.processor() or stdlib_platform.machine(),
                command=" ".join(sys.argv))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "recompute": recompute, "checks": checks,
                   "whole_run": serve}, f,
                  indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
