"""Summary of a benchmarks/run_llama_server.sh run: per GGUF file and run, batch-1 TPOT (p50
over the completions) and 32-concurrent output tok/s per round, and each kvstrata run's ratios
to llama-server taken within each round (TPOT: llama's / ours, > 1 = ours faster; tok/s:
ours / llama's), with their median over rounds. Printed and written to
<dir>/llama_server_summary.json.

    python benchmarks/llama_server_summary.py benchmarks/results/llama_server \
        --files Q4_1 Q8_0 --runs llama kv_packed kv_packed_q8 kv_bf16
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics


def rounds_of(out_dir: str, tag: str, kind: str) -> dict[int, dict]:
    """round -> bench serve's report for <tag>_<kind>.r<round>.json."""
    found = {}
    for path in glob.glob(os.path.join(glob.escape(out_dir), f"{tag}_{kind}.r*.json")):
        m = re.search(r"\.r(\d+)\.json$", path)
        if m:
            with open(path, encoding="utf-8") as fh:
                found[int(m.group(1))] = json.load(fh)
    return found


def metric(report: dict, kind: str) -> float | None:
    if report.get("completed", 0) == 0:
        return None
    return report["tpot_ms"]["p50"] if kind == "b1" else report["output_throughput"]


def summarize(out_dir: str, files: list[str], runs: list[str]) -> dict:
    table: dict = {}
    for fmt in files:
        per_run: dict = {}
        for run in runs:
            per_run[run] = {kind: {r: metric(rep, kind)
                                   for r, rep in sorted(rounds_of(
                                       out_dir, f"llama_{fmt}_{run}", kind).items())}
                            for kind in ("b1", "b32")}
        ratios: dict = {}
        base = per_run.get("llama")
        for run in runs:
            if run == "llama" or base is None:
                continue
            for kind in ("b1", "b32"):
                values = []
                for r, ours in per_run[run][kind].items():
                    theirs = base[kind].get(r)
                    if ours and theirs:  # TPOT: lower is better, so theirs / ours
                        values.append(theirs / ours if kind == "b1" else ours / theirs)
                if values:
                    ratios[f"{run}_{kind}"] = {"per_round": values,
                                               "median": statistics.median(values)}
        table[fmt] = {"values": per_run, "vs_llama": ratios}
    return table


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--files", nargs="+", required=True)
    p.add_argument("--runs", nargs="+", required=True)
    args = p.parse_args(argv)
    table = summarize(args.out_dir, args.files, args.runs)
    for fmt, entry in table.items():
        print(f"== {fmt}: batch-1 TPOT p50 ms | 32-concurrent tok/s, per round")
        for run, kinds in entry["values"].items():
            b1 = " / ".join("-" if v is None else f"{v:.2f}" for v in kinds["b1"].values())
            b32 = " / ".join("-" if v is None else f"{v:.1f}" for v in kinds["b32"].values())
            print(f"  {run:13s} {b1:>20s} ms | {b32:>16s} tok/s")
        for name, r in entry["vs_llama"].items():
            rounds = " / ".join(f"{v:.2f}" for v in r["per_round"])
            print(f"  {name} vs llama: {r['median']:.2f}x ({rounds})")
    with open(os.path.join(args.out_dir, "llama_server_summary.json"), "w",
              encoding="utf-8") as fh:
        json.dump(table, fh, indent=1)
    return table


if __name__ == "__main__":
    main()
