"""What --enable-deterministic-inference costs, measured in one process in CPU time: for a box
too busy for benchmarks/ab_deterministic.py's served figures (wall-clock TPOT there moves with
every other job; a 2-thread OpenMP step can wait 10x on a descheduled thread).

Two engines (flag on, flag off) stay loaded side by side, at one torch thread
(OMP_NUM_THREADS=1 is set here before torch loads); round after round, in alternating order,
each runs:
  - the served load's shape offline: --num-prompts random prompts of --input-len tokens,
    --concurrency running at once (max_running_requests), --output-len tokens each (greedy,
    ignore_eos): output tokens per CPU second;
  - batch 1: --batch1-prompts prompts one at a time, each generated to --output-len and to 1
    token; TPOT = (CPU time of the long run - the short one) / (output_len - 1).
Reported as on / off ratios per round and their median (throughput < 1 and TPOT > 1 mean it
costs). The cache is flushed before every run, so every prompt is cold.

  python benchmarks/ab_deterministic_offline.py --quantization gguf        # SmolLM2 kept packed
  python benchmarks/ab_deterministic_offline.py --dtype bfloat16 --rounds 3 --output-json d.json
  python benchmarks/ab_deterministic_offline.py --dtype bfloat16 --settings off on on-per-token

--settings: the engines, the first the baseline of the ratios; on-per-token is the flag with
KVSTRATA_CPU_DETERMINISTIC_BLOCKS=0 (every query in the paged decode kernel's order, as before
the prefill kernel's order).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402

# setting -> (the flag, environment while its engine is built)
SETTINGS = {"off": (False, {}), "on": (True, {}),
            "on-per-token": (True, {"KVSTRATA_CPU_DETERMINISTIC_BLOCKS": "0"})}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--settings", nargs="+", default=["off", "on"], choices=list(SETTINGS),
                   help="engines, the first the baseline of every ratio")
    add_round_args(p)
    return p.parse_args(argv)


def add_round_args(p, num_prompts: int = 64, concurrency: int = 32, input_len: int = 128,
                   output_len: int = 64, batch1_prompts: int = 4) -> None:
    """The arguments run_and_report reads (shared by the A/B scripts built on it)."""
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--concurrency", type=int, default=concurrency)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--batch1-prompts", type=int, default=batch1_prompts)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    add_quiet_arg(p)


def engine(args, on: bool, env: dict | None = None):
    from kvstrata import LLM

    env = env or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read while the engine is built
    try:
        # token ids in, token ids out: no tokenizer (the tiny random hybrids have none)
        return LLM(args.model, quantization=args.quantization, dtype=args.dtype,
                   skip_tokenizer_init=True,
                   enable_deterministic_inference=on, disable_deterministic_inference=not on,
                   max_running_requests=args.concurrency, max_total_tokens=65536)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def cpu_seconds(llm, prompts: list[list[int]], max_new: int) -> tuple[float, int]:
    """(CPU seconds, output tokens) of generating every prompt at once, cold."""
    llm.flush_cache()
    sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    start = time.process_time()
    outs = llm.generate(input_ids=prompts, sampling_params=sp)
    return time.process_time() - start, sum(len(o["output_ids"]) for o in outs)


def measure(args, llm, served: list[list[int]], single: list[list[int]]) -> dict:
    secs, tokens = cpu_seconds(llm, served, args.output_len)
    tpots = []
    for p in single:
        long, _ = cpu_seconds(llm, [p], args.output_len)
        short, _ = cpu_seconds(llm, [p], 1)
        tpots.append((long - short) / (args.output_len - 1) * 1000)
    return {"output_tok_per_cpu_s": tokens / secs, "batch1_tpot_cpu_ms": statistics.median(tpots)}


def alternate_rounds(args, llms: dict, served: list[list[int]], single: list[list[int]],
                     result: dict) -> None:
    """`llms` = {baseline name: LLM, candidate name: LLM, ...}: after a warm-up, args.rounds
    rounds of `measure` in alternating order, each round's candidate / baseline ratios and
    their medians into `result` ("rounds", "median_<candidate>_over_<baseline>")."""
    base, *cands = llms
    for s in llms:  # warm-up: lazy init, decode plans
        cpu_seconds(llms[s], served[:2], 4)
    for r in range(args.rounds):
        got = {}
        for s in (llms if r % 2 == 0 else reversed(llms)):
            # each as it lands: a run cut short by its timeout keeps them
            got[s] = measure(args, llms[s], served, single)
            print(f"round {r + 1} {s}: {got[s]}", flush=True)
        entry = dict(got)
        for cand in cands:
            ratio = {k: got[cand][k] / got[base][k] for k in got[cand]}
            entry[f"{cand}_over_{base}"] = ratio
            print(f"round {r + 1} {cand}: " + ", ".join(
                f"{k} {got[base][k]:.2f} -> {got[cand][k]:.2f} ({ratio[k]:.3f}x)"
                for k in ratio), flush=True)
        result["rounds"].append(entry)
    for cand in cands:
        key = f"{cand}_over_{base}"
        medians = {k: statistics.median(x[key][k] for x in result["rounds"])
                   for k in result["rounds"][0][key]}
        result[f"median_{key}"] = medians
        print(f"median {cand}/{base}: " + ", ".join(f"{k} {v:.3f}x"
                                                   for k, v in medians.items()))


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = {"args": vars(args), "load": announce_load(args.require_quiet), "rounds": []}
    llms = {s: engine(args, *SETTINGS[s]) for s in args.settings}
    vocab = next(iter(llms.values())).engine.runner.model.dims.vocab_size
    return run_and_report(args, llms, range(10, vocab), result)


def start_beside(args, prefix: str) -> tuple[dict, str]:
    """(the result's first fields, a fresh temporary folder) for an A/B script that writes
    its own model: the box's load announced, the compile cache kept in the folder."""
    result = {"args": vars(args), "load": announce_load(args.require_quiet), "rounds": []}
    tmp = tempfile.mkdtemp(prefix=prefix)
    os.environ.setdefault("XDG_CACHE_HOME", os.path.join(tmp, "cache"))
    return result, tmp


def engines_beside(path: str, args, runs: dict) -> dict:
    """{run name: LLM} for every run's flags over one model, loaded side by side."""
    from kvstrata import LLM

    return {name: LLM(model_path=path, skip_tokenizer_init=True,
                      max_running_requests=args.concurrency, max_total_tokens=16384, **kw)
            for name, kw in runs.items()}


def run_and_report(args, llms: dict, token_ids: range, result: dict) -> dict:
    """Random prompts of `token_ids` (args.seed), alternate_rounds over them, the engines shut
    down, the result written to args.output_json (if given) and returned."""
    rng = random.Random(args.seed)
    prompts = [[rng.choice(token_ids) for _ in range(args.input_len)]
               for _ in range(args.num_prompts + args.batch1_prompts)]
    alternate_rounds(args, llms, prompts[:args.num_prompts], prompts[args.num_prompts:], result)
    for llm in llms.values():
        llm.shutdown()
    if args.output_json:
        write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
