"""Summary of a benchmarks/run_vllm_cpu.sh run: output tok/s per run, the ratios the CPU-speed
issue asks for (kvstrata bf16 / fp32, kvstrata's best / vLLM CPU's best), and the CPU's ISA
flags, printed and written to <dir>/vllm_cpu_summary.json.

    python -m kvstrata.bench.peer_summary benchmarks/results kvstrata_fp32 kvstrata_bf16 ...
"""
from __future__ import annotations

import json
import os
import sys

from kvstrata.platform import read_cpu_flags

ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
             "amx_int8")


def cpu_isa(path: str = "/proc/cpuinfo") -> dict:
    """Model name and which of ISA_FLAGS the first CPU lists."""
    model = "unknown"
    try:
        with open(path, encoding="utf-8") as fh:
            model = next((line.partition(":")[2].strip() for line in fh
                          if line.partition(":")[0].strip() == "model name"), model)
    except OSError:
        pass
    flags = read_cpu_flags(path)
    return {"model": model, "flags": [f for f in ISA_FLAGS if f in flags]}


def summarize(results_dir: str, runs: list[str]) -> dict:
    tok_s = {}
    for run in runs:
        path = os.path.join(results_dir, f"serve_{run}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                tok_s[run] = json.load(fh)["output_throughput"]
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
    return {"output_tok_s": tok_s, "ratios": ratios, "cpu": cpu_isa()}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m kvstrata.bench.peer_summary DIR RUN [RUN ...]")
    report = summarize(argv[0], argv[1:])
    print(f"CPU: {report['cpu']['model']}; ISA: {' '.join(report['cpu']['flags'])}")
    for run, value in report["output_tok_s"].items():
        print(f"  {run:<16s} {value:8.1f} output tok/s")
    for name, value in report["ratios"].items():
        print(f"  {name}: {value:.2f}x" if isinstance(value, float) else f"  ({value})")
    with open(os.path.join(argv[0], "vllm_cpu_summary.json"), "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    return report


if __name__ == "__main__":
    main()
