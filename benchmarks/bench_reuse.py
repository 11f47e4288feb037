"""Multi-turn chat reuse per KV tier, same workload, same run: device only ("off"), + host
pool ("on", HiCache L2), + host + storage ("storage", HiCache L3); then a restart.

Several conversations, each with its own long context behind a shared system prompt, take
turns; their working set is about 4x the device pool, so without a host tier each turn's
prefix has been evicted and must be recomputed. Reports TTFT p50/p90 per mode, prompt tokens
served from device / host / storage / recomputed, total time; writes JSON and a PNG of TTFT
per turn.

Restart (needs the `file` storage backend): `--restart-prompts` requests, each a distinct
`--prefix-len`-token shared prefix plus a short question, on a server with an empty file
store (cold: computed), then on a fresh server over the same store (warm: the prefix comes
from L3). Reports TTFT p50/p90 of both and the cold/warm ratio.

    .venv/bin/python benchmarks/bench_reuse.py --out benchmarks/results/reuse.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import tempfile
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


def storage_backend() -> str:
    """`file` once that backend is installed (it survives a restart), else `memory`."""
    found = importlib.util.find_spec("kvstrata.kv.storage.file_store") is not None
    return "file" if found else "memory"


def tier_args(mode: str, args, store_dir: str | None = None) -> dict:
    if mode == "off":
        return {}
    extra = dict(enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio,
                 hicache_mem_layout=args.layout, hicache_io_backend=args.io)
    if mode != "on":  # storage / restart: + L3
        backend = "file" if store_dir else storage_backend()
        config = {"prefetch_threshold": args.page_size}
        if backend == "file":
            config["file_path"] = store_dir or tempfile.mkdtemp(prefix="kvstrata-bench-")
        extra.update(hicache_storage_backend=backend, hicache_storage_prefetch_policy=args.policy,
                     hicache_storage_backend_extra_config=json.dumps(config))
    return extra


def timed_request(llm, rid: str, ids: list[int], params) -> tuple[float, list[int], object]:
    """(TTFT, output ids, final RequestOutput) of one request run alone."""
    llm.engine.add_request(EngineRequest(rid, list(ids), params))
    t0, first, out_ids, final = time.perf_counter(), None, [], None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
            out_ids += out.new_token_ids
            if out.finished:
                final = out
    return first, out_ids, final


def run(mode: str, args, convs) -> dict:
    llm = LLM(model_path=args.model, skip_tokenizer_init=True, page_size=args.page_size,
              max_total_tokens=args.device_tokens, **tier_args(mode, args))
    params = SamplingParams(max_new_tokens=args.answer_len, ignore_eos=True, temperature=0)
    history = {c: list(parts[0]) for c, parts in convs}
    ttft, per_turn, served = [], [], {"prompt": 0, "cached": 0}
    start = time.perf_counter()
    for turn in range(args.turns):
        for c, parts in convs:
            history[c] += parts[1 + turn]
            first, out_ids, final = timed_request(llm, f"{mode}-{c}-{turn}", history[c], params)
            served["prompt"] += final.prompt_tokens
            served["cached"] += final.cached_tokens
            history[c] += out_ids
            if turn > 0:  # turn 0 is a cold start in both modes
                ttft.append(first)
            per_turn.append({"turn": turn, "conv": c, "ttft": first})
    total = time.perf_counter() - start
    load = llm.get_load()
    llm.check_integrity()
    llm.shutdown()
    # Storage hits are loaded back through the host tier: host_hit_tokens counts both.
    storage = load.get("hicache_storage_hit_tokens", 0)
    host = load.get("hicache_host_hit_tokens", 0) - storage
    return {**quantiles(ttft), "total_s": total,
            "prompt_tokens": served["prompt"], "from_host": host, "from_storage": storage,
            "from_device": served["cached"] - host - storage,
            "recomputed": served["prompt"] - served["cached"], "per_turn": per_turn}


def quantiles(ttft: list[float]) -> dict:
    qs = statistics.quantiles(ttft, n=10) if len(ttft) > 1 else [ttft[0]] * 9
    return {"ttft_p50": statistics.median(ttft), "ttft_p90": qs[8]}


def restart(args) -> dict:
    """Cold server on an empty file store, then a restarted one on the same store."""
    rng = random.Random(args.seed + 1)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prefix_len + args.user_len)]
               for _ in range(args.restart_prompts)]
    params = SamplingParams(max_new_tokens=args.answer_len, ignore_eos=True, temperature=0)
    store = tempfile.mkdtemp(prefix="kvstrata-bench-store-")
    result = {}
    for phase in ("cold", "warm"):
        llm = LLM(model_path=args.model, skip_tokenizer_init=True, page_size=args.page_size,
                  max_total_tokens=args.prefix_len * 2 + 1024,
                  **tier_args("restart", args, store_dir=store))
        ttft, outputs = [], []
        for i, ids in enumerate(prompts):
            first, out_ids, _ = timed_request(llm, f"{phase}-{i}", ids, params)
            ttft.append(first)
            outputs.append(out_ids)
        load = llm.get_load()
        llm.shutdown()  # the cold server's backups finish here
        result[phase] = {**quantiles(ttft), "outputs": outputs,
                         "from_storage": load.get("hicache_storage_hit_tokens", 0)}
    result["same_output"] = result["cold"]["outputs"] == result["warm"]["outputs"]
    result["ttft_p50_ratio"] = result["cold"]["ttft_p50"] / result["warm"]["ttft_p50"]
    return result


MODES = {"off": "device only", "on": "+ host (L2)", "storage": "+ host + storage (L3)"}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, label in MODES.items():
        ys = [p["ttft"] * 1000 for p in result[mode]["per_turn"]]
        ax.plot(range(len(ys)), ys, marker="o", label=label)
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
    ap.add_argument("--policy", default="timeout", help="storage prefetch policy")
    ap.add_argument("--prefix-len", type=int, default=4096, help="restart: shared prefix")
    ap.add_argument("--restart-prompts", type=int, default=3,
                    help="restart: distinct prefixes (0 skips the restart run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/reuse.json")
    add_quiet_arg(ap)
    args = ap.parse_args()
    box = announce_load(args.require_quiet)
    convs = workload(args)
    working_set = args.system_len + args.conversations * (
        args.context_len + args.turns * (args.user_len + args.answer_len))
    result = {"box_load": box, "working_set_tokens": working_set, "device_tokens": args.device_tokens,
              "storage_backend": storage_backend(),
              **{mode: run(mode, args, convs) for mode in MODES}}
    result["ttft_p50_off"] = result["off"]["ttft_p50"]
    result["ttft_p50_on"] = result["on"]["ttft_p50"]
    result["ttft_p50_ratio"] = result["ttft_p50_off"] / result["ttft_p50_on"]
    result["ttft_p50_storage_ratio"] = result["ttft_p50_off"] / result["storage"]["ttft_p50"]
    for mode, label in MODES.items():
        r = result[mode]
        print(f"{label:22s}: TTFT p50 {r['ttft_p50'] * 1000:7.1f} ms  p90 "
              f"{r['ttft_p90'] * 1000:7.1f} ms  total {r['total_s']:6.1f} s  prompt tokens: "
              f"device {r['from_device']}, host {r['from_host']}, storage "
              f"{r['from_storage']}, recomputed {r['recomputed']}")
    print(f"working set {working_set} tokens = {working_set / args.device_tokens:.1f}x the "
          f"device pool; TTFT p50 off/on = {result['ttft_p50_ratio']:.2f}x, off/storage = "
          f"{result['ttft_p50_storage_ratio']:.2f}x")
    if args.restart_prompts and storage_backend() == "file":
        r = result["restart"] = restart(args)
        print(f"restart, {args.prefix_len}-token prefix: cold TTFT p50 "
              f"{r['cold']['ttft_p50'] * 1000:.1f} ms p90 {r['cold']['ttft_p90'] * 1000:.1f} ms;"
              f" warm store p50 {r['warm']['ttft_p50'] * 1000:.1f} ms p90 "
              f"{r['warm']['ttft_p90'] * 1000:.1f} ms ({r['warm']['from_storage']} tokens from "
              f"storage); cold/warm = {r['ttft_p50_ratio']:.2f}x, same output: "
              f"{r['same_output']}")
    elif args.restart_prompts:
        print("restart run skipped: it needs the `file` storage backend")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
