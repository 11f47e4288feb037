"""Summary of a benchmarks/run_vllm_cpu.sh run: output tok/s per run, the ratios the CPU-speed
issue asks for (kvstrata bf16 / fp32, kvstrata's best / vLLM CPU's best), and the CPU's ISA
flags, printed and written to <dir>/vllm_cpu_summary.json.

With several rounds (serve_<run>.r<i>.json) the ratios are taken within each round -- the
runs of one round ran minutes apart, the rounds maybe an hour -- and reported per round and
as their median and range; tok/s per run is the median over rounds.

    python -m kvstrata.bench.peer_summary benchmarks/results kvstrata_fp32 kvstrata_bf16 ...
"""
from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys

from kvstrata.platform import read_cpu_flags, read_cpu_model

ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
             "amx_int8")


def cpu_isa(path: str = "/proc/cpuinfo") -> dict:
    """Model name and which of ISA_FLAGS the first CPU lists."""
    flags = read_cpu_flags(path)
    return {"model": read_cpu_model(path), "flags": [f for f in ISA_FLAGS if f in flags]}


def round_values(results_dir: str, run: str) -> list[float]:
    """Output tok/s of `run` in each round (serve_<run>.r<i>.json, by i), else of its one
    serve_<run>.json, else []."""
    paths = glob.glob(os.path.join(glob.escape(results_dir), f"serve_{run}.r*.json"))
    rounds = sorted((int(m.group(1)), p) for p in paths
                    if (m := re.search(r"\.r(\d+)\.json$", p)))
    if not rounds:
        single = os.path.join(results_dir, f"serve_{run}.json")
        rounds = [(1, single)] if os.path.exists(single) else []
    values = []
    for _, path in rounds:
        with open(path, encoding="utf-8") as fh:
            values.append(json.load(fh)["output_throughput"])
    return values


def ratios_of(tok_s: dict) -> dict:
    """The issue's ratios from one round's tok/s per run."""
    ours = {r: v for r, v in tok_s.items() if r.startswith("kvstrata")}
    peer = {r: v for r, v in tok_s.items() if r.startswith("vllm")}
    ratios = {}
    if "kvstrata_bf16" in tok_s and "kvstrata_fp32" in tok_s:
        ratios["kvstrata_bf16_over_fp32"] = tok_s["kvstrata_bf16"] / tok_s["kvstrata_fp32"]
    if "kvstrata_auto" in tok_s and "kvstrata_fp32" in tok_s:
        ratios["kvstrata_auto_over_fp32"] = tok_s["kvstrata_auto"] / tok_s["kvstrata_fp32"]
    if ours and peer:
        best, best_peer = max(ours, key=ours.get), max(peer, key=peer.get)
        ratios["best_kvstrata_over_best_vllm"] = ours[best] / peer[best_peer]
        ratios["best"] = f"{best} vs {best_peer}"
    return ratios


def summarize(results_dir: str, runs: list[str]) -> dict:
    per_run = {run: v for run in runs if (v := round_values(results_dir, run))}
    n_rounds = max((len(v) for v in per_run.values()), default=0)
    per_round = [ratios_of({run: v[i] for run, v in per_run.items() if i < len(v)})
                 for i in range(n_rounds)]
    tok_s = {run: statistics.median(v) for run, v in per_run.items()}
    ratios = {}
    for name in dict.fromkeys(k for r in per_round for k in r):
        values = [r[name] for r in per_round if name in r]
        if isinstance(values[0], float):
            ratios[name] = statistics.median(values)
            if len(values) > 1:
                ratios[f"{name}_range"] = [min(values), max(values)]
        else:
            ratios[name] = values[-1]
    return {"output_tok_s": tok_s, "rounds": n_rounds, "tok_s_per_round": per_run,
            "ratios_per_round": per_round, "ratios": ratios, "cpu": cpu_isa()}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m kvstrata.bench.peer_summary DIR RUN [RUN ...]")
    report = summarize(argv[0], argv[1:])
    print(f"CPU: {report['cpu']['model']}; ISA: {' '.join(report['cpu']['flags'])}")
    for run, value in report["output_tok_s"].items():
        rounds = report["tok_s_per_round"][run]
        each = f"  (rounds: {', '.join(f'{v:.1f}' for v in rounds)})" if len(rounds) > 1 else ""
        print(f"  {run:<16s} {value:8.1f} output tok/s{each}")
    for name, value in report["ratios"].items():
        if isinstance(value, float):
            print(f"  {name}: {value:.2f}x" + (" (median of rounds)"
                                                if report["rounds"] > 1 else ""))
        elif isinstance(value, list):
            print(f"  {name}: {value[0]:.2f}-{value[1]:.2f}x")
        else:
            print(f"  ({value})")
    with open(os.path.join(argv[0], "vllm_cpu_summary.json"), "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    return report


if __name__ == "__main__":
    main()
