"""The HiCache benchmark scripts run end to end on tiny inputs and write what issue 5 asks
for (JSON fields, a PNG). Their figures are not checked here: performance goals live in
benchmarks/ and docs/benchmarks.md, not in timed tests."""
from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys

import pytest
import torch

from kvstrata.kv.io_backends import SUPPORTED_LAYOUTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The bound each script had as a subprocess (timeout=300): a hung script fails here, not at
# the suite's global 600 s.
pytestmark = pytest.mark.timeout(300)


@contextlib.contextmanager
def _worker_state_kept():
    """What a script run in this process may change for the rest of this test worker (the
    intra-op thread count, the environment, sys.path, sys.argv) is put back afterwards."""
    threads, env, path, argv = torch.get_num_threads(), dict(os.environ), list(sys.path), sys.argv
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:], sys.argv = path, argv


def _run(script: str, *args: str) -> None:
    """Run benchmarks/<script> as `python <script> args` does (runpy, as __main__), but in
    this process: a subprocess paid ~3 s of CPU to import torch and kvstrata again for each
    script."""
    with _worker_state_kept():
        sys.argv = [os.path.join(ROOT, "benchmarks", script), *args]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:
            assert e.code in (None, 0), f"{script} exited with {e.code}"


def test_bench_transfer_rows(tmp_path):
    out = tmp_path / "transfer.json"
    _run("bench_transfer.py", "--layers", "2", "--kv-heads", "2", "--head-dim", "16",
         "--page-size", "4", "--pages", "4", "16", "--reps", "1", "--threads", "1",
         "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    pairs = {(io, layout) for io, layouts in SUPPORTED_LAYOUTS.items() for layout in layouts}
    assert {(r["io"], r["layout"]) for r in rows} == pairs
    assert {r["direction"] for r in rows} == {"d2h", "h2d", "h2d_layers"}
    assert {r["pages"] for r in rows} == {4, 16}
    for r in rows:
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["ratio"] > 0
    assert (tmp_path / "transfer.png").stat().st_size > 0


def test_gemm_peak_skips_a_gemm_far_below_the_best(monkeypatch):
    """bench_decode_step's peak is the fastest GEMM of the process at the dtype; one under a
    quarter of the best at n / 8 is not probed at n (torch's bf16 matmul on AVX2 took 15
    minutes there), and one that does not run here (None) is left out."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import time

    import bench_decode_step

    built = []

    def gemm(name, seconds):
        def make(n, dtype):
            built.append((name, n))
            return lambda: time.sleep(seconds * n / 16)
        return make

    monkeypatch.setattr(bench_decode_step, "GEMMS", {
        "fast": gemm("fast", 0.002), "slow": gemm("slow", 0.02),
        "absent": lambda n, dtype: None})
    peak, name = bench_decode_step.gemm_peak(128, torch.bfloat16, probes=1)
    assert name == "fast" and peak > 0
    assert ("slow", 128) not in built and ("slow", 16) in built and ("fast", 128) in built
    # Within the floor both are probed at full size and the faster one is named.
    built.clear()
    monkeypatch.setitem(bench_decode_step.GEMMS, "slow", gemm("slow", 0.003))
    assert bench_decode_step.gemm_peak(128, torch.bfloat16, probes=1)[1] == "fast"
    assert ("slow", 128) in built


def test_bench_paged_decode_rows(tmp_path, monkeypatch):
    """In-process (no server, no model): every dtype x ISA cap row, which ISA ran, the copy
    baseline; the user's KVSTRATA_CPU_ISA is restored afterwards."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_paged_decode

    monkeypatch.setenv("KVSTRATA_CPU_ISA", "avx512")
    out = tmp_path / "paged_decode.json"
    result = bench_paged_decode.main(["--batch", "3", "--context", "20", "--pool-pages", "9",
                                      "--rounds", "2", "--dtypes", "float32", "float16",
                                      "--out", str(out)])
    assert os.environ["KVSTRATA_CPU_ISA"] == "avx512"
    rows = json.loads(out.read_text())["rows"]
    assert rows == result["rows"] and len(rows) == 6
    assert {r["ran"] for r in rows if r["cap"] == "scalar"} == {"scalar"}
    for r in rows:
        assert r["us"] > 0 and r["copy_us"] > 0 and r["vs_copy"] > 0
    with pytest.raises(ValueError, match="--pool-pages"):
        bench_paged_decode.main(["--batch", "3", "--context", "20", "--pool-pages", "5"])
    two = bench_paged_decode.main(["--batch", "3", "--context", "20", "--pool-pages", "9",
                                   "--rounds", "1", "--dtypes", "bfloat16", "--isas", "avx512",
                                   "--query-dtype", "pool", "--layers", "2"])["rows"]
    assert len(two) == 1 and two[0]["us"] > 0 and two[0]["gb_s"] > 0  # 2 layers, bf16 query


def test_bench_prefill_attention_rows(tmp_path, monkeypatch):
    """In-process: a row per dtype x length x ISA cap with SDPA measured beside it, which ISA
    ran, the kernel's difference from SDPA (small: a wrong kernel shows here), JSON out; the
    user's KVSTRATA_CPU_ISA is restored afterwards."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_prefill_attention

    monkeypatch.setenv("KVSTRATA_CPU_ISA", "avx512")
    out = tmp_path / "prefill.json"
    result = bench_prefill_attention.main(["--lengths", "9", "70", "--rounds", "1", "--isas",
                                           "scalar", "avx512", "--out", str(out)])
    assert os.environ["KVSTRATA_CPU_ISA"] == "avx512"
    rows = json.loads(out.read_text())["rows"]
    assert rows == result["rows"] and len(rows) == 8
    assert {r["ran"] for r in rows if r["cap"] == "scalar"} == {"scalar"}
    for r in rows:
        assert r["ms"] > 0 and r["sdpa_ms"] > 0 and r["vs_sdpa"] > 0
        assert r["max_abs_err"] < (1e-5 if r["dtype"] == "float32" else 5e-2), r


def test_bench_prefill_attention_whole_prefills(tiny_model_path):
    """--model: the two engines (kernel, SDPA) time each wave; a malformed wave is refused."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_prefill_attention

    result = bench_prefill_attention.main(["--lengths", "--model", tiny_model_path, "--prompts",
                                           "2x24", "1x40", "--rounds", "1"])
    assert result["rows"] == []
    assert [w["wave"] for w in result["prefills"]] == ["2x24", "1x40"]
    assert all(w["kernel_s"] > 0 and w["sdpa_s"] > 0 for w in result["prefills"])
    with pytest.raises(ValueError, match="COUNTxLEN"):
        bench_prefill_attention.main(["--lengths", "--model", tiny_model_path, "--prompts", "40"])


def test_bench_gemv_rows_and_decode_steps(tmp_path, tiny_model_path):
    """In-process: GEMV (GEMM above its rows) vs oneDNN vs a read per shape and row count
    (their difference from F.linear is small: a wrong kernel shows here), and --model's decode
    steps with and without the copies, and (--gemm-ab, where the CPU takes the fp32 GEMM)
    with the GEMM on and off in one engine; JSON out; a row count below 1 is refused."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_gemv
    from kvstrata.platform import read_cpu_flags

    out = tmp_path / "gemv.json"
    result = bench_gemv.main(["--shapes", "o", "down", "--rows", "1", "4", "20", "--layers", "2",
                              "--rounds", "1", "--model", tiny_model_path, "--batches", "1",
                              "--tokens", "3", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"] and len(result["rows"]) == 6
    for r in result["rows"]:
        assert r["gemv_gb_s"] > 0 and r["onednn_gb_s"] > 0 and r["read_gb_s"] > 0
        assert r["max_abs_err"] < 1e-3, r
    assert [d["batch"] for d in saved["decode"]] == [1]
    flags = read_cpu_flags()
    if {"avx2", "fma", "f16c"} <= flags and "avx512f" not in flags:
        ab = bench_gemv.main(["--shapes", "--model", tiny_model_path, "--batches", "20",
                              "--tokens", "8", "--rounds", "2", "--gemm-ab"])
        assert [d["batch"] for d in ab["decode"]] == [20]
        assert ab["decode"][0]["gemm_step_ms"] > 0 and ab["decode"][0]["onednn_step_ms"] > 0
    with pytest.raises(ValueError, match="--rows"):
        bench_gemv.main(["--rows", "0"])


def test_bench_reuse_on_vs_off(tmp_path, tiny_model_path):
    out = tmp_path / "reuse.json"
    _run("bench_reuse.py", "--model", tiny_model_path, "--conversations", "3", "--turns", "3",
         "--system-len", "32", "--context-len", "48", "--user-len", "8", "--answer-len", "4",
         "--device-tokens", "128", "--page-size", "4", "--prefix-len", "64",
         "--restart-prompts", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["ttft_p50_ratio"] == result["ttft_p50_off"] / result["ttft_p50_on"]
    # The working set exceeds the device pool: without HiCache nothing comes from the host,
    # with it some prompt tokens do.
    assert result["working_set_tokens"] > result["device_tokens"]
    assert result["off"]["from_host"] == 0 and result["on"]["from_host"] > 0
    assert result["storage"]["from_storage"] >= 0 and result["on"]["from_storage"] == 0
    if "restart" in result:  # with the file backend: the warm server reads the prefix back
        assert result["restart"]["same_output"] and result["restart"]["warm"]["from_storage"] > 0
    assert (tmp_path / "reuse.png").stat().st_size > 0


def test_bench_int8_linear_rows(tmp_path):
    """Every shape x kernel has a row; the int8 result stays close to float32 (the kernels'
    speed is reported in docs/benchmarks.md, not asserted)."""
    out = tmp_path / "int8.json"
    # Two of SmolLM2's three shapes (its 576 -> 49152 head takes most of the time to quantise
    # for every kernel; the script treats every shape alike).
    _run("bench_int8_linear.py", "--rows", "1", "3", "--min-time", "0.001",
         "--shapes", "576:1536", "1536:576", "--torchao-max-flops", "0", "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    assert {(r["kernel"], r["k"], r["n"], r["rows"]) for r in rows} == {
        (kern, k, n, m) for kern in ("kvstrata", "kvstrata_fbgemm", "fbgemm_dyn", "torchao")
        for k, n in ((576, 1536), (1536, 576)) for m in (1, 3)}
    from kvstrata.runner.quant.w8a8 import cpu_has_vnni
    for r in rows:
        if r["kernel"] == "torchao":
            assert r["skipped"]
            continue
        assert r["ms"] > 0 and r["ratio"] > 0
        # fbgemm's own dynamic int8 (a baseline) saturates int16 pairs without VNNI: its
        # error is only bounded on a VNNI CPU; ours (7-bit activations there) always is.
        if r["kernel"].startswith("kvstrata") or cpu_has_vnni():
            assert r["error"] < 0.1, r


def test_bench_gguf_linear_rows(tmp_path):
    """A row per format x row count with every baseline's time and ratio; --prefill adds the
    dequantize-then-matmul baseline (speed in docs/benchmarks.md, not asserted)."""
    out = tmp_path / "gguf.json"
    _run("bench_gguf_linear.py", "--shapes", "tiny", "--formats", "Q4_0", "Q4_K", "--rows", "1",
         "5", "--rounds", "1", "--prefill", "--out", str(out))
    rows = json.loads(out.read_text())["results"]
    assert [(r["format"], r["rows"]) for r in rows] == [
        ("Q4_0", 1), ("Q4_0", 5), ("Q4_K", 1), ("Q4_K", 5)]
    for r in rows:
        for base in ("memcpy", "torch_f32", "torch_bf16", "kv_bf16", "deq_mm"):
            assert r[f"{base}_ms"] > 0 and r[f"vs_{base}"] > 0, (base, r)


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_bench_gemm_rows(tmp_path, kind, tiny_model_path):
    """Both GEMMs of a kind per row count, the same values (the script checks it), or a clear
    line on a CPU without the instructions ours needs; --head: the output head's shape;
    --model: whole decode steps and prefills of two engines."""
    from kvstrata.runner.cpu.int8_linear import own_gemm_fits
    from kvstrata.runner.cpu.packed_linear import own_bf16_fits
    out = tmp_path / "gemm.json"
    _run("bench_gemm.py", "--kind", kind, "--rows", "1", "5", "--copies", "1", "--rounds", "1",
         "--out", str(out), "--model", tiny_model_path, "--batches", "1", "3", "--tokens", "3",
         "--head")
    fits = (own_gemm_fits(576, 960) if kind == "int8" else
            own_bf16_fits(torch.empty(960, 576, dtype=torch.bfloat16)))
    if not fits:
        assert not out.exists()
        return
    report = json.loads(out.read_text())
    rows = report["results"]
    assert report["kind"] == kind
    assert [r["rows"] for r in rows] == [1, 5] and all(r["calls"] == 4 for r in rows)
    assert all(r["kvstrata_ms"] > 0 and r["onednn_ms"] > 0 and r["ratio"] > 0 for r in rows)
    assert [r["batch"] for r in report["decode"]] == [1, 3]
    assert [r["rows"] for r in report["head"]] == [1, 5]  # the output head's shape apart
    assert all(r["kvstrata_ms"] > 0 and r["onednn_ms"] > 0 for r in report["head"])
    assert all(r["first_ms"] > 0 and r["baseline_first_ms"] > 0 for r in report["decode"])


def test_bench_pd_runs_both_setups(tmp_path, tiny_model_path):
    """bench_pd.py starts a co-located server, then router + prefill + decode (tcp), runs
    the same load through both, and measures the transfer layer beside a raw socket."""
    out = tmp_path / "pd.json"
    _run("bench_pd.py", "--model", tiny_model_path, "--backends", "tcp", "--num-prompts", "4",
         "--concurrency", "2", "--input-len", "40", "--output-len", "4", "--page-size", "4",
         "--max-total-tokens", "4096", "--transfer-page-tokens", "16",
         "--transfer-pages", "16", "--output-json", str(out))
    result = json.loads(out.read_text())
    for setup in ("colocated", "tcp"):
        assert result[setup]["completed"] == 4 and result[setup]["failed"] == 0, \
            (setup, result[setup]["errors"])
        assert result[setup]["ttft_ms"]["p50"] > 0
    assert set(result["tcp"]["vs_colocated"]) == {"ttft_p50", "ttft_p99", "tpot_p50",
                                                  "tpot_p99", "output_tok_s"}
    (rate,) = result["tcp"]["transfer"]
    assert rate["page_tokens"] == 16 and rate["gbps"] > 0 and rate["loopback_socket_gbps"] > 0
    assert "box_load" in result


def test_bench_retraction_rows(tmp_path, tiny_model_path):
    """bench_retraction.py times backup/restore per backend (cpu_tensor, every allowed
    host layout x IO) and a prefill of the same length as the recompute baseline."""
    out = tmp_path / "retraction.json"
    _run("bench_retraction.py", "--layers", "2", "--kv-heads", "2", "--head-dim", "16",
         "--page-size", "4", "--tokens", "30", "--reps", "1", "--threads", "1",
         "--model", tiny_model_path, "--recompute-reps", "1", "--out", str(out))
    result = json.loads(out.read_text())
    pairs = {(io, layout) for io, layouts in SUPPORTED_LAYOUTS.items() for layout in layouts}
    rows = result["rows"]
    assert {(r["io"], r["layout"]) for r in rows if r["backend"] == "host_pool"} == pairs
    assert [r["backend"] for r in rows].count("cpu_tensor") == 1
    assert result["meta"]["geometry"]["pages"] == 8
    assert result["recompute"]["recompute_s"] > 0
    for r in rows:
        assert r["backup_s"] > 0 and r["restore_s"] > 0 and r["recompute_over_restore"] > 0
    assert len(result["checks"]) == 2 * len(pairs)  # vs cpu_tensor, vs recompute
    assert "box_load" in result["meta"]


def test_bench_decode_step_rows(tmp_path, tiny_model_path):
    """Both decode variants and the prefill are timed and profiled against the GEMM peak
    (here with int8 linear layers: their weights count one byte each in the roofline)."""
    out = tmp_path / "decode_step.json"
    _run("bench_decode_step.py", "--model", tiny_model_path, "--batch", "3", "--context", "5",
         "40", "--prefill", "24", "--steps", "1", "--rounds", "1", "--gemm-size", "128",
         "--quantization", "w8a8_int8", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["quantization"] == "w8a8_int8"
    assert report["gemm_peak_gflops"] > 0 and report["linear_params"] > 0
    assert report["gemm_peak_kernel"] in ("torch.matmul", "kvstrata bf16 GEMM")
    assert [r["context"] for r in report["decode"]] == [5, 40]
    for row in report["decode"]:
        for variant in ("kernel", "gather_sdpa"):
            v = row[variant]
            assert v["ms"] > 0 and 0 < v["of_peak"] and v["top_ops"]
            assert 0 < v["attention_share"] < 1  # the kernel shows up as an op of its own
            assert 0 < v["linears_alone_share"]
        assert row["linears_alone_ms"] > 0 and row["head_alone_ms"] > 0
    assert report["prefill"]["tokens"] == 24 and report["prefill"]["ms"] > 0


def test_ab_dtype_times_both_dtypes_interleaved(tmp_path, tiny_model_path):
    """ab_dtype.py (what --dtype auto on a CPU is chosen by) times decode steps and prefills of
    both dtypes, a ratio per round; here fp32 against bf16 with int8 layers too."""
    out = tmp_path / "ab_dtype.json"
    _run("ab_dtype.py", "--model", tiny_model_path, "--batch", "1", "3", "--context", "12",
         "--prefill", "2x16", "--rounds", "2", "--steps", "1", "--quantization", "w8a8_int8",
         "--out", str(out))
    report = json.loads(out.read_text())
    assert report["dtypes"] == ["float32", "bfloat16"]
    assert report["quantization"] == "w8a8_int8"
    assert sorted(report["decode"]) == ["1", "3"] and list(report["prefill"]) == ["2x16"]
    for row in [*report["decode"].values(), *report["prefill"].values()]:
        assert len(row["ratios"]) == 2 and row["median_ratio"] > 0
        for dtype in report["dtypes"]:
            assert len(row["ms"][dtype]) == 2 and min(row["ms"][dtype]) > 0


def test_ab_fused_ops_runs_both_variants(tiny_model_path, capsys):
    """The fused-ops A/B times both variants (bf16, so every fused path is taken) and the
    "torch ops" variant really declines every fused call."""
    _run("ab_fused_ops.py", "--model", tiny_model_path, "--batch", "3", "--context", "20",
         "--rounds", "1", "--steps", "1")
    stdout = capsys.readouterr().out
    assert "torch ops" in stdout and "x" in stdout.split("->")[-1]
    # the plan's A/B with int8 layers (the plan runs them as the model's own linear call)
    _run("ab_fused_ops.py", "--model", tiny_model_path, "--batch", "2", "--context", "20",
         "--rounds", "1", "--steps", "1", "--dtype", "float32", "--paths", "plan",
         "--quantization", "w8a8_int8")
    assert "float32 w8a8_int8 B=2 C=20 plan: layer loop" in capsys.readouterr().out
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import ab_fused_ops
        import torch
        from kvstrata.runner.cpu import fused_ops as cpu_ops
        from kvstrata.runner.models import decode_plan
        x = torch.randn(2, 64, dtype=torch.bfloat16)
        cos = torch.ones(2, 1, 32, dtype=torch.bfloat16)
        ab_fused_ops.use_fused(False)
        assert not cpu_ops.rope_(x, 2, cos, cos) and cpu_ops.add_rms_norm(x, x, x[0], 1e-6) is None
        assert cpu_ops.rms_norm(x, x[0], 1e-6) is not None  # not among the default paths
        ab_fused_ops.use_fused(False, ["norm"])
        assert cpu_ops.rms_norm(x.float(), x[0].float(), 1e-6) is None
        assert cpu_ops.rope_(x, 2, cos, cos)
        ab_fused_ops.use_fused(True)
        assert cpu_ops.rope_(x, 2, cos, cos)
        assert cpu_ops.rms_norm(x.float(), x[0].float(), 1e-6) is not None
        assert not decode_plan.enabled()  # the plan replays fused calls: off unless its A/B
        ab_fused_ops.use_fused(True, ["plan"])
        assert decode_plan.enabled()
        ab_fused_ops.use_fused(False, ["plan"])
        assert not decode_plan.enabled() and cpu_ops.rope_(x, 2, cos, cos)
    finally:
        ab_fused_ops.restore()
        assert decode_plan.enabled()  # the worker's later tests run the plan again
        sys.path.pop(0)


def test_bench_storage_rows(tmp_path):
    """Every backend (mooncake when its client imports) x page size x put/get has a row with
    its raw-file baseline; the script itself checks every page read back exactly."""
    out = tmp_path / "storage.json"
    _run("bench_storage.py", "--layers", "2", "--kv-heads", "2", "--head-dim", "16",
         "--page-sizes", "4", "1", "--total-mib", "1", "--reps", "1", "--dir", str(tmp_path),
         "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    backends = {r["backend"] for r in rows}
    assert {"memory", "file"} <= backends <= {"memory", "file", "mooncake"}
    assert {(r["backend"], r["op"], r["page_size"]) for r in rows} == {
        (b, op, p) for b in backends for op in ("put", "get") for p in (4, 1)}
    for r in rows:
        assert r["gbps"] > 0 and r["raw_gbps"] > 0 and r["ratio"] > 0
    assert os.listdir(tmp_path) == ["storage.json"]  # its files are gone


def test_bench_spec_rows(tmp_path, tiny_model_path):
    """`kvstrata bench spec`: plain and NGRAM rows per workload and batch size, with the
    ratios, and greedy outputs equal to plain decoding's."""
    out = tmp_path / "spec.json"
    from kvstrata.entrypoints import cli

    with _worker_state_kept():
        assert cli.main(["bench", "spec", "--model", tiny_model_path, "--batch-sizes", "1", "3",
                         "--output-len", "8", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["warmup_reps"] == 1 and result["reps"] == 1
    rows = result["rows"]
    assert {(r["workload"], r["batch"], r["setup"]) for r in rows} == {
        (w, b, s) for w in ("chat", "repeat") for b in (1, 3) for s in ("plain", "NGRAM")}
    for r in rows:
        assert r["tok_s"] > 0 and r["tpot_p50_ms"] > 0 and r["same_output"], r
        if r["setup"] == "NGRAM":
            assert r["accept_length"] >= 1.0 and r["tpot_ratio"] > 0


def test_train_eagle_head_saves_a_head_the_engine_serves(tmp_path, tiny_model_path):
    """benchmarks/train_eagle_head.py on the tiny target: the checkpoint it writes is an
    EAGLE head kvstrata loads (every tensor it expects, none missing) and drafts with, and
    greedy output stays the target's own."""
    from kvstrata import LLM

    out = tmp_path / "head"
    _run("train_eagle_head.py", "--model", tiny_model_path, "--out", str(out), "--prompts",
         "6", "--output-len", "12", "--epochs", "2")
    info = json.loads((out / "training.json").read_text())
    assert info["sequences"] == 6 and len(info["epochs"]) == 2
    assert all(e["smooth_l1"] >= 0 and e["ce"] > 0 for e in info["epochs"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    ids = [[5, 9, 13, 2, 7, 11, 3], [4, 4, 8, 15, 16, 23, 42, 1]]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    plain = LLM(model_path=tiny_model_path, page_size=4, max_total_tokens=2048)
    eagle = LLM(model_path=tiny_model_path, page_size=4, max_total_tokens=2048,
                speculative_algorithm="EAGLE", speculative_draft_model_path=str(out),
                speculative_num_steps=2, speculative_disable_by_batch_size=8)
    try:
        want = [o["output_ids"] for o in plain.generate(input_ids=ids, sampling_params=params)]
        got = eagle.generate(input_ids=ids, sampling_params=params)
        assert [o["output_ids"] for o in got] == want
        assert all(o["meta_info"]["spec_draft_token_num"] > 0 for o in got)
    finally:
        plain.shutdown()
        eagle.shutdown()


def test_random_smollm2_writes_an_hf_checkpoint_of_the_config(tmp_path, tiny_model_path):
    """benchmarks/random_smollm2.py (the device machine's stand-in for the GGUF): the config's
    shapes under HF's names (transformers loads it with nothing missing or unexpected), the
    tokenizer copied, the same seed the same weights, another seed others."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import random_smollm2

    a, b, c = (str(tmp_path / n) for n in "abc")
    random_smollm2.main([a, "--from", tiny_model_path])
    random_smollm2.main([b, "--from", tiny_model_path])
    random_smollm2.main([c, "--from", tiny_model_path, "--seed", "1"])
    _model, info = AutoModelForCausalLM.from_pretrained(a, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert os.path.exists(os.path.join(a, "tokenizer.json"))
    wa, wb, wc = (load_file(os.path.join(d, "model.safetensors")) for d in (a, b, c))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    key = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(wa[key], wc[key])


def test_device_scripts_parse_and_name_their_stages():
    """benchmarks/device/*.sh run only on the lent device machine, where a slip costs its
    15 minutes: both parse, every stage the header lists has its case arm (and none more), and
    prepare.sh downloads what run.sh installs into (.whl) and the config it reads (.devrun)."""
    import re
    import subprocess

    run_sh = os.path.join(ROOT, "benchmarks", "device", "run.sh")
    prep_sh = os.path.join(ROOT, "benchmarks", "device", "prepare.sh")
    for path in (run_sh, prep_sh):
        subprocess.run(["bash", "-n", path], check=True)
    text = open(run_sh).read()
    listed = set(re.findall(r"^#   (\w+) ", text, re.M))
    arms = set(re.findall(r"^  (\w+)\) ", text, re.M))
    stages = {"kernel", "cuda", "gemm", "attn", "step", "served", "threads", "probe", "suite"}
    assert listed == arms == stages, (listed, arms)
    assert ".whl/*.whl" in text and ".devrun/smol" in text
    prep = open(prep_sh).read()
    assert "-d .whl" in prep and ".devrun/smol" in prep
