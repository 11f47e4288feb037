"""benchmarks/run_vllm_cpu.sh's summary (kvstrata.bench.peer_summary): tok/s per run from
bench serve's JSON, the issue's ratios, the CPU's ISA flags."""
from __future__ import annotations

import json

from kvstrata.bench import peer_summary


def test_ratios(tmp_path):
    for run, tok_s in {"kvstrata_fp32": 200.0, "kvstrata_bf16": 400.0, "kvstrata_auto": 410.0,
                       "vllm_bf16": 205.0, "vllm_fp32": 100.0}.items():
        (tmp_path / f"serve_{run}.json").write_text(json.dumps({"output_throughput": tok_s}))
    report = peer_summary.summarize(str(tmp_path), ["kvstrata_fp32", "kvstrata_bf16",
                                                    "kvstrata_auto", "vllm_bf16", "vllm_fp32",
                                                    "kvstrata_w8a8"])  # w8a8: no file
    r = report["ratios"]
    assert r["kvstrata_bf16_over_fp32"] == 2.0 and r["kvstrata_auto_over_fp32"] == 2.05
    assert r["best_kvstrata_over_best_vllm"] == 2.0 and r["best"] == "kvstrata_auto vs vllm_bf16"
    assert "kvstrata_w8a8" not in report["output_tok_s"]


def test_cpu_isa_reads_model_and_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 fma avx512f "
                    "amx_bf16\n")
    assert peer_summary.cpu_isa(str(info)) == {"model": "Test CPU",
                                               "flags": ["avx2", "fma", "avx512f", "amx_bf16"]}
    assert peer_summary.cpu_isa(str(tmp_path / "none")) == {"model": "unknown", "flags": []}
