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


def test_rounds_pair_ratios_within_a_round(tmp_path):
    """ROUNDS > 1: ratios are taken inside each round, then their median and range; tok/s per
    run is the median over rounds; a lone serve_<run>.json is ignored once rounds exist."""
    rounds = [{"kvstrata_w8a8": 600.0, "kvstrata_bf16": 500.0, "kvstrata_fp32": 250.0,
               "vllm_bf16": 250.0},
              {"kvstrata_w8a8": 540.0, "kvstrata_bf16": 450.0, "kvstrata_fp32": 300.0,
               "vllm_bf16": 300.0},
              {"kvstrata_w8a8": 660.0, "kvstrata_bf16": 560.0, "kvstrata_fp32": 260.0,
               "vllm_bf16": 260.0}]
    for i, values in enumerate(rounds, start=1):
        for run, tok_s in values.items():
            (tmp_path / f"serve_{run}.r{i}.json").write_text(
                json.dumps({"output_throughput": tok_s}))
    (tmp_path / "serve_kvstrata_w8a8.json").write_text(json.dumps({"output_throughput": 1.0}))
    report = peer_summary.summarize(str(tmp_path), list(rounds[0]))
    assert report["rounds"] == 3 and report["output_tok_s"]["kvstrata_w8a8"] == 600.0
    best = [r["best_kvstrata_over_best_vllm"] for r in report["ratios_per_round"]]
    assert best == [2.4, 1.8, 660.0 / 260.0]
    r = report["ratios"]
    assert r["best_kvstrata_over_best_vllm"] == 2.4  # the median of the paired ratios
    assert r["best_kvstrata_over_best_vllm_range"] == [1.8, 660.0 / 260.0]
    assert r["kvstrata_bf16_over_fp32"] == 2.0 and r["best"] == "kvstrata_w8a8 vs vllm_bf16"
    printed = peer_summary.main([str(tmp_path), *rounds[0]])
    assert printed["ratios"] == r and (tmp_path / "vllm_cpu_summary.json").exists()
