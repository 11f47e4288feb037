"""The recurrent layers' kernels (kvstrata/runner/recurrent/) against transformers' torch
references on the same inputs, measured in the same run, one layer at a released model's
shape: Gated DeltaNet as Qwen3-Next-80B (16 key heads, 32 value heads of 128) and Mamba2 as
Nemotron-H-8B (128 heads of 64, d_state 128, 8 groups).

  prefill  our chunked scan vs transformers' per-token loop (torch_recurrent_gated_delta_rule;
           selective_state_update token by token) and its chunked torch fallback
           (torch_chunk_gated_delta_rule; mamba2_chunk_scan)
  decode   our one-token step over a batch, in place on a state pool (the C kernel,
           runner/recurrent/fused_step.py) and as torch ops (gated_delta_step / ssd_step on
           the gathered states), vs transformers' recurrent step on the same batch

  python benchmarks/bench_recurrent_kernels.py --lengths 256 1024 --batches 1 8
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import announce_load  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402
from kvstrata.runner.recurrent import fused_step  # noqa: E402
from kvstrata.runner.recurrent.gated_delta import chunk_gated_delta, gated_delta_step  # noqa
from kvstrata.runner.recurrent.ssd import discretize_dt, ssd_chunk_scan, ssd_step  # noqa: E402

GDN = dict(hk=16, hv=32, dk=128, dv=128)
SSD = dict(heads=128, p=64, groups=8, n=128)
LOOP_MAX = 512  # the per-token loop runs this many tokens at most (its time scales linearly)


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _gdn_inputs(b: int, length: int, g):
    s = GDN
    return (torch.randn(b, length, s["hk"], s["dk"], generator=g),
            torch.randn(b, length, s["hk"], s["dk"], generator=g),
            torch.randn(b, length, s["hv"], s["dv"], generator=g),
            -torch.rand(b, length, s["hv"], generator=g) * 0.5,
            torch.rand(b, length, s["hv"], generator=g),
            torch.randn(b, s["hv"], s["dk"], s["dv"], generator=g))


def _ssd_inputs(b: int, length: int, g):
    s = SSD
    return (torch.randn(b, length, s["heads"], s["p"], generator=g),
            torch.randn(b, length, s["heads"], generator=g),
            -torch.rand(s["heads"], generator=g) - 0.1,
            torch.randn(b, length, s["groups"], s["n"], generator=g),
            torch.randn(b, length, s["groups"], s["n"], generator=g),
            torch.randn(s["heads"], generator=g), torch.randn(s["heads"], generator=g),
            torch.randn(b, s["heads"], s["p"], s["n"], generator=g))


def _hf_ssd_loop(mamba2, x, dt, A, B, C, D, bias, state):
    p, n = x.shape[-1], B.shape[-1]
    s = state.clone()
    for t in range(x.shape[1]):
        mamba2.mamba2_selective_state_update(
            s, x[:, t], dt[:, t, :, None].expand(-1, -1, p), A[:, None, None].expand(-1, p, n),
            B[:, t], C[:, t], D[:, None].expand(-1, p), dt_bias=bias[:, None].expand(-1, p),
            dt_softplus=True)


def prefill(lengths: list[int], reps: int) -> list[dict]:
    from transformers.models.mamba2 import modeling_mamba2 as mamba2
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    rows, g = [], torch.Generator().manual_seed(0)
    for length in lengths:
        q, k, v, gg, beta, s = _gdn_inputs(1, length, g)
        loop_n = min(length, LOOP_MAX)
        ours = _best(lambda: chunk_gated_delta(q, k, v, gg, beta, s), reps)
        hf_chunk = _best(lambda: qwen3_next.torch_chunk_gated_delta_rule(
            q, k, v, g=gg, beta=beta, initial_state=s, output_final_state=True,
            use_qk_l2norm_in_kernel=True), reps)
        hf_loop = _best(lambda: qwen3_next.torch_recurrent_gated_delta_rule(
            q[:, :loop_n], k[:, :loop_n], v[:, :loop_n], g=gg[:, :loop_n],
            beta=beta[:, :loop_n], initial_state=s, output_final_state=True,
            use_qk_l2norm_in_kernel=True), 1) * length / loop_n
        rows.append(dict(kernel="gated_delta prefill", tokens=length, ours_ms=ours * 1e3,
                         hf_chunk_ms=hf_chunk * 1e3, hf_loop_ms=hf_loop * 1e3))
        x, dt, A, B, C, D, bias, st = _ssd_inputs(1, length, g)
        dtd = discretize_dt(dt, bias, (0.0, float("inf")))
        ours = _best(lambda: ssd_chunk_scan(x, dtd, A, B, C, D, st), reps)
        hf_chunk = _best(lambda: mamba2.mamba2_chunk_scan(
            x, dt, A, B, C, chunk_size=256, D=D, dt_bias=bias, initial_states=st,
            dt_softplus=True, return_final_states=True), reps)
        hf_loop = _best(lambda: _hf_ssd_loop(
            mamba2, x[:, :loop_n], dt[:, :loop_n], A, B[:, :loop_n], C[:, :loop_n], D, bias,
            st), 1) * length / loop_n
        rows.append(dict(kernel="ssd prefill", tokens=length, ours_ms=ours * 1e3,
                         hf_chunk_ms=hf_chunk * 1e3, hf_loop_ms=hf_loop * 1e3))
    return rows


def _pool(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's states at scattered slots of a pool four times its size."""
    b = states.shape[0]
    slots = torch.randperm(4 * b)[:b]
    pool = torch.zeros(4 * b, *states.shape[1:])
    pool[slots] = states
    return pool, slots


def decode(batches: list[int], reps: int) -> list[dict]:
    from transformers.models.mamba2 import modeling_mamba2 as mamba2
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    rows, g = [], torch.Generator().manual_seed(1)
    for b in batches:
        q, k, v, gg, beta, s = _gdn_inputs(b, 1, g)
        pool, slots = _pool(s)
        torch_ms = _best(lambda: gated_delta_step(q[:, 0], k[:, 0], v[:, 0], gg[:, 0],
                                                  beta[:, 0], pool[slots]), reps)
        ours = _best(lambda: fused_step.gated_delta_step(pool, slots, q[:, 0], k[:, 0],
                                                         v[:, 0], gg[:, 0], beta[:, 0]), reps)
        hf = _best(lambda: qwen3_next.torch_recurrent_gated_delta_rule(
            q, k, v, g=gg, beta=beta, initial_state=s, output_final_state=True,
            use_qk_l2norm_in_kernel=True), reps)
        rows.append(dict(kernel="gated_delta decode", batch=b, ours_ms=ours * 1e3,
                         torch_step_ms=torch_ms * 1e3, hf_loop_ms=hf * 1e3))
        x, dt, A, B, C, D, bias, st = _ssd_inputs(b, 1, g)
        dtd = discretize_dt(dt[:, 0], bias, (0.0, float("inf")))
        pool, slots = _pool(st)
        torch_ms = _best(lambda: ssd_step(x[:, 0], dtd, A, B[:, 0], C[:, 0], D, pool[slots]),
                         reps)
        ours = _best(lambda: fused_step.ssd_step(pool, slots, x[:, 0], dtd, A, B[:, 0],
                                                 C[:, 0], D), reps)
        hf = _best(lambda: _hf_ssd_loop(mamba2, x, dt, A, B, C, D, bias, st), reps)
        rows.append(dict(kernel="ssd decode", batch=b, ours_ms=ours * 1e3,
                         torch_step_ms=torch_ms * 1e3, hf_loop_ms=hf * 1e3))
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="*", default=[256, 1024])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--require-quiet", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    announce_load(args.require_quiet)
    torch.set_num_threads(args.threads)
    rows = prefill(args.lengths, args.reps) + decode(args.batches, args.reps)
    for r in rows:
        size = f"{r['tokens']} tokens" if "tokens" in r else f"batch {r['batch']}"
        extra = (f", transformers chunked {r['hf_chunk_ms']:.1f} ms "
                 f"({r['hf_chunk_ms'] / r['ours_ms']:.2f}x)" if "hf_chunk_ms" in r else
                 f", our torch step {r['torch_step_ms']:.2f} ms "
                 f"({r['torch_step_ms'] / r['ours_ms']:.1f}x)")
        print(f"{r['kernel']:20s} {size:12s} ours {r['ours_ms']:9.2f} ms; transformers loop "
              f"{r['hf_loop_ms']:9.1f} ms ({r['hf_loop_ms'] / r['ours_ms']:.1f}x){extra}")
    result = {"threads": args.threads, "rows": rows}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
