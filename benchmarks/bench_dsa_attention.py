"""DSA: does top-k sparsity pay? Attention time of decode steps on one long prompt with the
top-k sparse path (each query reads index_topk latent rows, after the indexer scored every
earlier token) vs the dense MLA path (each query reads every earlier latent row), same
model, same KV, same run. Attention time = the DSA backend's per-layer forward (KV write,
indexer scores, top-k, latent attention); the whole decode step is reported too.

    python benchmarks/bench_dsa_attention.py                       # tiny-dsa, 2048 tokens
    python benchmarks/bench_dsa_attention.py --prompt-len 4096 --out benchmarks/results/dsa.json

The prompt is >= 4x index_topk (64 for tiny-dsa). Ratios, not absolute times, are the result.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time


def _timed(backend) -> list[float]:
    """Wrap backend.forward to accumulate its wall time."""
    spent = [0.0]
    inner = backend.forward

    def forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    backend.forward = forward
    return spent


def run(args: argparse.Namespace) -> dict:
    import torch

    from kvstrata.bench.box_load import announce_load
    from kvstrata.bench.offline import build_tiny_dsa_checkpoint
    from kvstrata.config.server_args import ServerArgs
    from kvstrata.entrypoints.engine_factory import build_runner
    from kvstrata.protocol import (NewRequestData, SamplingParams, ScheduledRequest,
                                   SchedulerOutput)

    load = announce_load(args.require_quiet)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_tiny_dsa_checkpoint(os.path.join(tmp, "tiny-dsa"))
        P = 16
        total = args.prompt_len + 3 * (args.steps + 1) + P  # three modes of decode steps
        runner, *_ = build_runner(ServerArgs(model_path=path, page_size=P,
                                             max_total_tokens=total, context_length=total,
                                             max_running_requests=2))
    backend = runner.model.attn_backend
    topk = runner.model.dims.index_topk
    if args.prompt_len < 4 * topk:
        raise ValueError(f"--prompt-len must be >= 4 x index_topk ({4 * topk})")
    spent = _timed(backend)
    rng = random.Random(0)
    prompt = [rng.randrange(10, runner.vocab_size - 10) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_new_tokens=1 << 20, ignore_eos=True)
    step, pos, token, new = 0, 0, None, [NewRequestData("r", prompt, [], params)]

    def one_step(tokens: list[int]) -> int:
        nonlocal step, pos, new
        slots = list(range(P + pos, P + pos + len(tokens)))  # pages 1.. in order
        last = pos + len(tokens) >= len(prompt)
        out = runner.execute(SchedulerOutput(step, False, new, [ScheduledRequest(
            "r", 1, pos, tokens, pos, slots, last)], []))
        step, pos, new = step + 1, pos + len(tokens), []
        return out.token_ids[0] if last else -1

    with torch.inference_mode():
        for lo in range(0, len(prompt), args.chunk):
            token = one_step(prompt[lo:lo + args.chunk])
        result: dict = {"prompt_len": args.prompt_len, "index_topk": topk,
                        "steps": args.steps, "threads": args.threads, "box_load": load}
        for mode in ("sparse", "dense", "sparse_again"):
            backend.dense = mode == "dense"
            one_step([token])  # warm-up at this mode
            spent[0] = 0.0
            start = time.perf_counter()
            for _ in range(args.steps):
                token = one_step([token])
            step_s = (time.perf_counter() - start) / args.steps
            result[mode] = {"attention_ms_per_token": spent[0] / args.steps * 1e3,
                            "step_ms": step_s * 1e3}
            print(f"{mode:13s} attention {result[mode]['attention_ms_per_token']:8.2f} ms/token,"
                  f" whole decode step {step_s * 1e3:8.2f} ms")
    sparse = min(result["sparse"]["attention_ms_per_token"],
                 result["sparse_again"]["attention_ms_per_token"])
    result["dense_over_sparse_attention"] = result["dense"]["attention_ms_per_token"] / sparse
    print(f"dense / sparse attention time: {result['dense_over_sparse_attention']:.2f}x "
          f"(prompt {args.prompt_len} tokens, index_topk {topk})")
    runner.shutdown()
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


def main(argv: list[str] | None = None) -> dict:
    from kvstrata.bench.box_load import add_quiet_arg

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a DeepseekV32 dir (default: tiny-dsa)")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk size")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per mode")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    add_quiet_arg(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
