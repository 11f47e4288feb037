"""Profile of one decode step (batch B, context C) and one long prefill of SmolLM2 on the CPU,
against the machine's fp32 GEMM peak measured in the same run (issue: a decode step close to
the GEMM limit).

For each context length it times the decode step with the paged decode kernel
(runner/attention/paged_decode.py) and with the gather + SDPA path it replaces, interleaved,
and reports: ms per step, achieved GFLOP/s (linear layers incl. the output head + attention
scores and values) as a fraction of the GEMM peak, and where the time goes (torch profiler:
the top ops by self time, and the share of the step spent outside torch ops = Python and
dispatch overhead). KV contents are left as allocated (zeros): timings do not depend on them,
and filling 32 x 512 positions by prefill would take minutes.

  python benchmarks/bench_decode_step.py --batch 32 --context 128 512 --prefill 2048 \
      --out benchmarks/results/decode_step.json
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
from kvstrata.config.kv_plan import KVPlan  # noqa: E402
from kvstrata.protocol.sampling_params import SamplingParams  # noqa: E402
from kvstrata.protocol.scheduler_output import (NewRequestData, ScheduledRequest,  # noqa: E402
                                                SchedulerOutput)
from kvstrata.runner.cpu.packed_linear import (LAYER_LINEARS, PackedLinear,  # noqa: E402
                                               own_bf16_fits)
from kvstrata.runner.model_runner import ModelRunner  # noqa: E402

PAGE = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1 << 20)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model and KV dtype; the GEMM peak is measured at the same dtype")
    p.add_argument("--quantization", default=None, choices=[None, "w8a8_int8"],
                   help="int8 linear layers (the GEMM peak stays the float dtype's)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, nargs="+", default=[128, 512])
    p.add_argument("--prefill", type=int, default=2048, help="prompt length of the prefill "
                   "profile (0: skip)")
    p.add_argument("--prefill-prompts", type=int, default=1, help="the prefill's tokens as "
                   "this many prompts of equal length in one batch (served load: a 2048-token "
                   "chunk of ~13 prompts of ~158)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--gemm-size", type=int, default=2048)
    p.add_argument("--out", default="benchmarks/results/decode_step.json")
    add_quiet_arg(p)
    return p.parse_args(argv)


def _torch_matmul(n: int, dtype: torch.dtype):
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return lambda: a @ b


def _own_gemm(n: int, dtype: torch.dtype):
    """kvstrata's bf16 GEMM as the engine calls it (a PackedLinear over an n x n weight), or
    None where it does not take bf16 on this CPU (the engine then uses oneDNN's, which the
    torch matmul probe measures)."""
    if dtype != torch.bfloat16 or not own_bf16_fits(torch.empty(n, n, dtype=dtype)):
        return None
    layer = PackedLinear(torch.randn(n, n).to(dtype))
    x = torch.randn(n, n).to(dtype)
    return lambda: layer(x)


GEMMS = {"torch.matmul": _torch_matmul, "kvstrata bf16 GEMM": _own_gemm}


def gemm_peak(n: int, dtype: torch.dtype = torch.float32, probes: int = 3,
              floor: float = 0.25) -> tuple[float, str]:
    """(GFLOP/s, kernel) of the fastest n x n x n GEMM this process has at `dtype`: torch's
    matmul and, for bf16 where it runs, kvstrata's own GEMM; each the best of `probes` rounds
    of 3 timed calls, 0.3 s apart. A peak is what the machine can do, so the best round
    counts: one round on this shared 2-vCPU box read 385 or 785 GFLOP/s minutes apart (bf16),
    which made "% of peak" figures swing 2x with the probe rather than with the step.
    A GEMM under `floor` of the best at n / 8 is not probed at n: torch's bf16 matmul without
    AVX-512 runs at ~0.3 GFLOP/s (its 2048^3 probes took 15 minutes, session 24)."""
    names = [name for name, make in GEMMS.items() if make(16, dtype) is not None]
    if len(names) > 1:
        small = max(16, n // 128 * 16)
        rates = {}
        for name in names:
            fn = GEMMS[name](small, dtype)
            fn()
            rates[name] = 1 / min(_timed(fn) for _ in range(3))
        names = [name for name in names if rates[name] >= floor * max(rates.values())]
    results = {}
    for name in names:
        fn = GEMMS[name](n, dtype)
        fn()
        best = float("inf")
        for i in range(probes):
            if i:
                time.sleep(0.3)
            best = min(best, min(_timed(fn) for _ in range(3)))
        results[name] = 2 * n ** 3 / best / 1e9
    name = max(results, key=results.get)
    return results[name], name


def copy_bandwidth(nbytes: int = 512 << 20) -> float:
    """GB/s of one large copy (read + write counted once each, as a step's reads are): the
    machine's streaming rate from RAM, larger than any L3, measured in the same run."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    return 2 * nbytes / best / 1e9


def step_bytes(elem: int, params: int, batch: int, context: int, dims,
               weight_elem: int | None = None) -> int:
    """Bytes a decode step must read from RAM at least (`elem` bytes a KV value, `weight_elem`
    a weight, default the same): every linear weight once (together they outsize any cache)
    and every request's K and V rows in every layer."""
    kv = 2 * batch * (context + 1) * dims.num_kv_heads * dims.head_dim * dims.num_layers
    return params * (elem if weight_elem is None else weight_elem) + kv * elem


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _numel(w) -> int:
    return w.numel() if isinstance(w, torch.Tensor) else w.in_features * w.out_features


def model_head_params(model: torch.nn.Module) -> int:
    return _numel(model.lm_head)


def linear_params(model: torch.nn.Module) -> int:
    """Weights every token multiplies: each layer's linear weights (qkv, o, gate/up, down) and
    the output head (the embedding matrix when tied); the embedding lookup is not a matmul.
    A weight may be a plain tensor or a packed layer (oneDNN, int8) with in/out features."""
    per_layer = sum(_numel(getattr(layer, name)) for layer in model.layers
                    for name, _ in LAYER_LINEARS)
    return per_layer + model_head_params(model)


def linears_alone_ms(model: torch.nn.Module, batch: int, dtype: torch.dtype,
                     reps: int = 3) -> tuple[float, float]:
    """ms of one step's matmuls alone: every layer's linear weights and the output head
    applied through the model's own linear call (packed / quantised as served) to a random
    [batch, in] input -- what the step would cost with nothing but its GEMMs, at its own
    shapes (best of `reps`) -- and of the output head alone: on 16 AMX cores oneDNN's bf16
    linears took 24.0 ms here while bench_gemm.py timed the layers' shapes at 10.6 ms, so the
    one wide GEMM is worth seeing apart."""
    weights = [getattr(layer, name) for layer in model.layers for name, _ in LAYER_LINEARS]
    weights.append(model.lm_head)

    def width(w) -> int:  # a plain weight [out, in] or a packed / quantised layer
        return w.shape[1] if isinstance(w, torch.Tensor) else w.in_features
    inputs = {}
    for w in weights:
        inputs.setdefault(width(w), torch.randn(batch, width(w)).to(dtype))

    def run(ws=weights):
        for w in ws:
            model.linear(inputs[width(w)], w)
    run()
    return (min(_timed(run) for _ in range(reps)) * 1e3,
            min(_timed(lambda: run(weights[-1:])) for _ in range(reps)) * 1e3)


class DecodeBatch:
    """B requests whose req_to_token rows already list C positions; each step decodes one
    token at position C (the same slot every step, so the batch stays the same).
    `first_state_slot`: a model with recurrent state decodes request b in state slot
    first_state_slot + b (its state, like the K/V, left as allocated)."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, first_row: int,
                 first_page: int, first_state_slot: int = 0):
        self.runner, self.batch, self.context = runner, batch, context
        self.first_state_slot = first_state_slot
        pages_per = context // PAGE + 1
        self.last_page = first_page + batch * pages_per - 1
        self.reqs = []
        new = []
        for b in range(batch):
            rid = f"c{context}-{b}"
            base = first_page + b * pages_per
            slots = [(base + p // PAGE) * PAGE + p % PAGE for p in range(context + 1)]
            self.reqs.append((rid, first_row + b, slots))
            new.append(NewRequestData(rid, [5 + b % 50] * context, [], GREEDY))
        self._step(new, first=True)

    def _step(self, new=(), first=False):
        state = self.first_state_slot
        sched = [ScheduledRequest(rid, row, self.context, [17], 0 if first else self.context,
                                  slots if first else slots[-1:], True,
                                  state_slot=state + b if state else 0)
                 for b, (rid, row, slots) in enumerate(self.reqs)]
        return self.runner.execute(SchedulerOutput(0, False, list(new), sched, []))

    def step(self):
        return self._step()

    def free(self):
        self.runner.execute(SchedulerOutput(0, False, [], [], [r[0] for r in self.reqs]))


def prefill_fn(runner: ModelRunner, prompts: int, length: int, first_row: int,
               first_page: int):
    """One batched prefill of `prompts` prompts of `length` tokens, each on its own row and
    pages from `first_row` / `first_page`, freed after it: a callable to time."""
    new, sched = [], []
    for i in range(prompts):
        prompt = [5 + (i + t) % 1000 for t in range(length)]
        page0 = first_page + i * (length // PAGE + 1)
        slots = [(page0 + p // PAGE) * PAGE + p % PAGE for p in range(length)]
        new.append(NewRequestData(f"prefill{i}", prompt, [], GREEDY))
        sched.append(ScheduledRequest(f"prefill{i}", first_row + i, 0, prompt, 0, slots, True))

    def run():
        runner.execute(SchedulerOutput(0, True, new, sched, []))
        runner.execute(SchedulerOutput(0, False, [], [], [r.rid for r in new]))
    return run


ATTENTION_OPS = ("kvstrata::paged_decode", "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::index_select")


def profile(fn, steps: int) -> tuple[list[dict], float, float]:
    """Top ops by self CPU time, the share of wall time outside torch ops, and the share in
    decode attention (the kernel, or the gather + SDPA it replaces)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    rows = [{"op": e.key, "share": e.self_cpu_time_total / 1e6 / wall} for e in top]
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION_OPS) / 1e6
    return rows, max(0.0, 1 - in_ops / wall), attention / wall


def attention_flops(batch: int, context: int, dims) -> int:
    return 4 * batch * (context + 1) * dims.num_heads * dims.head_dim * dims.num_layers


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = announce_load(args.require_quiet)
    peak, peak_kernel = gemm_peak(args.gemm_size, getattr(torch, args.dtype))
    bandwidth = copy_bandwidth()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {args.dtype} GEMM "
          f"peak {peak:.1f} GFLOP/s ({args.gemm_size}^3, {peak_kernel}); copy "
          f"{bandwidth:.1f} GB/s")
    runner = ModelRunner(args.model, dtype=args.dtype, device="cpu",
                         quantization=args.quantization)
    dims = runner.model.dims
    prompts = max(1, args.prefill_prompts)
    rows_needed = args.batch * len(args.context) + 1 + prompts
    pages = (sum(args.batch * (c // PAGE + 1) for c in args.context) + args.prefill // PAGE +
             2 * prompts)
    runner.allocate_kv(KVPlan.mha(num_layers=dims.num_layers, num_kv_heads=dims.num_kv_heads,
                                  head_dim=dims.head_dim, dtype=args.dtype, page_size=PAGE,
                                  num_pages=pages, num_rows=rows_needed,
                                  context_len=max(max(args.context), args.prefill) + 1))
    backend = runner.model.attn_backend
    # The paged kernel variant runs only where the backend would use it (its dtypes).
    variants = (True, False) if backend.use_kernel else (False,)
    params = linear_params(runner.model)
    report = {"box_load": load, "dtype": args.dtype, "quantization": args.quantization,
              "threads": torch.get_num_threads(),
              "gemm_peak_gflops": peak, "gemm_peak_kernel": peak_kernel,
              "copy_gb_s": bandwidth, "linear_params": params,
              "decode": [], "prefill": None}
    first_row, first_page = 1, 1
    with torch.inference_mode():
        for context in args.context:
            batch = DecodeBatch(runner, args.batch, context, first_row, first_page)
            first_row, first_page = first_row + args.batch, batch.last_page + 1
            flops = 2 * params * args.batch + attention_flops(args.batch, context, dims)
            times = {True: [], False: []}
            for _ in range(args.rounds):
                for kernel in variants:
                    backend.use_kernel = kernel
                    batch.step()  # warm-up of this variant
                    times[kernel].append(min(_timed(batch.step) for _ in range(args.steps)))
            # Probed again after the timed steps: the peak is the best of both probes, so a
            # probe taken in a slow minute cannot inflate "% of peak" (one run of session 17
            # read 722 GFLOP/s at the start against 816-819 in the runs around it).
            again, again_kernel = gemm_peak(args.gemm_size, getattr(torch, args.dtype),
                                            probes=2)
            if again > peak:
                print(f"GEMM peak probed again after the steps: {again:.1f} GFLOP/s (was "
                      f"{peak:.1f}); the figures below use it", flush=True)
                peak = report["gemm_peak_gflops"] = again
                report["gemm_peak_kernel"] = again_kernel
            elem = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
            nbytes = step_bytes(elem, params, args.batch, context, dims,
                                1 if args.quantization else None)
            # The step cannot beat the slower of its arithmetic at the GEMM peak and its
            # reads at the copy rate (a roofline from two baselines of this run).
            roofline_ms = max(flops / peak / 1e6, nbytes / bandwidth / 1e6)
            linears_ms, head_ms = linears_alone_ms(runner.model, args.batch,
                                                   getattr(torch, args.dtype))
            row = {"batch": args.batch, "context": context, "flops_per_step": flops,
                   "bytes_per_step": nbytes, "roofline_ms": roofline_ms,
                   "linears_alone_ms": linears_ms, "head_alone_ms": head_ms}
            print(f"decode B={args.batch}: its linears alone (the model's own calls at these "
                  f"shapes) {linears_ms:.1f} ms = {2 * params * args.batch / linears_ms / 1e6:.1f}"
                  f" GFLOP/s = {2 * params * args.batch / linears_ms / 1e6 / peak:.1%} of peak"
                  f" (the output head {head_ms:.1f} ms of it)", flush=True)
            for kernel, name in ((True, "kernel"), (False, "gather_sdpa")):
                if kernel not in variants:
                    continue
                backend.use_kernel = kernel
                ms = statistics.median(times[kernel]) * 1e3
                top, overhead, attention = profile(batch.step, args.steps)
                row[name] = {"ms": ms, "gflops": flops / ms / 1e6,
                             "of_peak": flops / ms / 1e6 / peak,
                             "linears_alone_share": linears_ms / ms,
                             "of_roofline": roofline_ms / ms, "outside_ops": overhead,
                             "attention_share": attention, "top_ops": top}
                print(f"decode B={args.batch} C={context:<5d} {name:<11s} {ms:8.1f} ms  "
                      f"{flops / ms / 1e6:6.1f} GFLOP/s = {flops / ms / 1e6 / peak:5.1%} of "
                      f"peak, {roofline_ms / ms:5.1%} of the roofline; attention "
                      f"{attention:5.1%}; outside torch ops {overhead:5.1%}; "
                      "top: " + ", ".join(
                          f"{t['op']} {t['share']:.0%}" for t in top[:4]), flush=True)
            if "kernel" in row:
                row["kernel_speedup"] = row["gather_sdpa"]["ms"] / row["kernel"]["ms"]
                print(f"  paged decode kernel: {row['kernel_speedup']:.2f}x the gather + SDPA "
                      "step")
            report["decode"].append(row)
            batch.free()
        backend.use_kernel = variants[0]
        if args.prefill:
            length = args.prefill // prompts
            run_prefill = prefill_fn(runner, prompts, length, first_row, first_page)
            run_prefill()
            ms = min(_timed(run_prefill) for _ in range(2)) * 1e3
            # Every layer for every token, the output head for each prompt's last position
            # (logits are computed only where a token is sampled); causal attention: half of
            # 4 * T^2 * H * D per layer and prompt.
            head = model_head_params(runner.model)
            flops = 2 * (params - head) * length * prompts + 2 * head * prompts + \
                2 * length ** 2 * prompts * dims.num_heads * dims.head_dim * dims.num_layers
            top, overhead, _ = profile(run_prefill, 1)
            report["prefill"] = {"tokens": length * prompts, "prompts": prompts, "ms": ms,
                                 "gflops": flops / ms / 1e6,
                                 "of_peak": flops / ms / 1e6 / peak, "outside_ops": overhead,
                                 "top_ops": top}
            print(f"prefill {prompts} x {length} tokens {ms:8.1f} ms  "
                  f"{flops / ms / 1e6:6.1f} GFLOP/s "
                  f"= {flops / ms / 1e6 / peak:5.1%} of peak; outside torch ops {overhead:5.1%};"
                  " top: " + ", ".join(f"{t['op']} {t['share']:.0%}" for t in top[:4]))
    runner.shutdown()
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
