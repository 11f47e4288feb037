"""Multi-turn chat reuse: HiCache L2 on vs off, same workload, same run.

Several conversations, each with its own long context behind a shared system prompt, take
turns; their working set is about 4x the device pool, so without a host tier each turn's
prefix has been evicted and must be recomputed. Reports TTFT p50/p90 per mode, prompt tokens
served from device / host / recomputed, total time; writes JSON and a PNG of TTFT per turn.

    .venv/bin/python benchmarks/bench_reuse.py --out benchmarks/results/reuse.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from kvstrata import LLM, SamplingParams
from kvstrata.bench.box_load import add_quiet_arg, announce_load
from kvstrata.engine.request import EngineRequest


def workload(args) -> list[tuple[int, list[list[int]]]]:
    """Per conversation: the context, then one user message per turn (token ids)."""
    rng = random.Random(args.seed)
    tok = lambda n: [rng.randrange(100, 40000) for _ in range(n)]  # noqa: E731
    system = tok(args.system_len)
    return [(c, [system + tok(args.context_len)] + [tok(args.user_len) for _ in range(args.turns)])
            for c in range(args.conversations)]


def run(mode: str, args, convs) -> dict:
    extra = {}
    if mode == "on":
        extra = dict(enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio,
                     hicache_mem_layout=args.layout, hicache_io_backend=args.io)
    llm = LLM(model_path=args.model, skip_tokenizer_init=True, page_size=args.page_size,
              max_total_tokens=args.device_tokens, **extra)
    params = SamplingParams(max_new_tokens=args.answer_len, ignore_eos=True, temperature=0)
    history = {c: list(parts[0]) for c, parts in convs}
    ttft, per_turn, served = [], [], {"prompt": 0, "cached": 0}
    start = time.perf_counter()
    for turn in range(args.turns):
        for c, parts in convs:
            history[c] += parts[1 + turn]
            rid = f"{mode}-{c}-{turn}"
            llm.engine.add_request(EngineRequest(rid, list(history[c]), params))
            t0, first, out_ids = time.perf_counter(), None, []
            while llm.engine.has_unfinished_requests():
                for out in llm.engine.step():
                    if out.new_token_ids and first is None:
                        first = time.perf_counter() - t0
                    out_ids += out.new_token_ids
                    if out.finished:
                        served["prompt"] += out.prompt_tokens
                        served["cached"] += out.cached_tokens
            history[c] += out_ids
            if turn > 0:  # turn 0 is a cold start in both modes
                ttft.append(first)
            per_turn.append({"turn": turn, "conv": c, "ttft": first})
    total = time.perf_counter() - start
    load = llm.get_load()
    llm.check_integrity()
    llm.shutdown()
    host = load.get("hicache_host_hit_tokens", 0)
    qs = statistics.quantiles(ttft, n=10)
    return {"ttft_p50": statistics.median(ttft), "ttft_p90": qs[8], "total_s": total,
            "prompt_tokens": served["prompt"], "from_host": host,
            "from_device": served["cached"] - host, "recomputed": served["prompt"] - served["cached"],
            "per_turn": per_turn}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in ("off", "on"):
        ys = [p["ttft"] * 1000 for p in result[mode]["per_turn"]]
        ax.plot(range(len(ys)), ys, marker="o", label=f"HiCache {mode}")
    ax.set_xlabel("request (turn-major)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Multi-turn reuse, working set ~4x the device pool")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--context-len", type=int, default=384)
    ap.add_argument("--user-len", type=int, default=48)
    ap.add_argument("--answer-len", type=int, default=16)
    ap.add_argument("--device-tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--hicache-ratio", type=float, default=6.0)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--io", default="kernel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/reuse.json")
    add_quiet_arg(ap)
    args = ap.parse_args()
    box = announce_load(args.require_quiet)
    convs = workload(args)
    working_set = args.system_len + args.conversations * (
        args.context_len + args.turns * (args.user_len + args.answer_len))
    result = {"box_load": box, "working_set_tokens": working_set, "device_tokens": args.device_tokens,
              "off": run("off", args, convs), "on": run("on", args, convs)}
    result["ttft_p50_off"] = result["off"]["ttft_p50"]
    result["ttft_p50_on"] = result["on"]["ttft_p50"]
    result["ttft_p50_ratio"] = result["ttft_p50_off"] / result["ttft_p50_on"]
    for mode in ("off", "on"):
        r = result[mode]
        print(f"HiCache {mode:3s}: TTFT p50 {r['ttft_p50'] * 1000:7.1f} ms  p90 "
              f"{r['ttft_p90'] * 1000:7.1f} ms  total {r['total_s']:6.1f} s  prompt tokens: "
              f"device {r['from_device']}, host {r['from_host']}, recomputed {r['recomputed']}")
    print(f"working set {working_set} tokens = {working_set / args.device_tokens:.1f}x the "
          f"device pool; TTFT p50 off/on = {result['ttft_p50_ratio']:.2f}x")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
