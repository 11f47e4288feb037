"""Structured output's cost: decode throughput of a batch under a JSON schema (and a regex)
against the same batch unconstrained, in one process and run (ratios, not bare timings).

Every request runs to max_new_tokens (ignore_eos: a grammar that is complete allows only
EOS, so each run decodes the same number of tokens), greedy, on SmolLM2 by default; rounds
alternate the variants so the box's noise hits them alike.

  .venv/bin/python benchmarks/bench_structured_output.py --out \\
      benchmarks/results/structured_output.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "hobbies"]}
VARIANTS = {"plain": {}, "json_schema": {"json_schema": json.dumps(PERSON)},
            "regex": {"regex": r"([A-Z][a-z]+ ){3,40}[A-Z][a-z]+\."}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/structured_output.json")
    add_quiet_arg(p)
    args = p.parse_args()
    load = announce_load(args.require_quiet)
    from kvstrata import LLM

    llm = LLM(args.model)
    prompts = [f"<|im_start|>user\nDescribe person number {i} as JSON with name, age, city "
               f"and hobbies.<|im_end|>\n<|im_start|>assistant\n" for i in range(args.batch)]
    for extra in VARIANTS.values():  # warm-up: the grammar tokenizer, compiled kernels
        llm.generate(prompts[:2], {"max_new_tokens": 4, "temperature": 0, **extra})
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, extra in VARIANTS.items():
            sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0,
                  "ignore_eos": True, **extra}
            start = time.perf_counter()
            outs = llm.generate(prompts, sp)
            elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o["output_ids"]) for o in outs) / elapsed)
    base = statistics.median(rates["plain"])
    result = {"model": args.model, "batch": args.batch, "box_load": load,
              "max_new_tokens": args.max_new_tokens, "tok_per_s": rates,
              "ratio_vs_plain": {name: statistics.median(r) / base
                                 for name, r in rates.items()}}
    for name, ratio in result["ratio_vs_plain"].items():
        print(f"{name:12s} {statistics.median(rates[name]):8.1f} tok/s  {ratio:.3f}x plain")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
