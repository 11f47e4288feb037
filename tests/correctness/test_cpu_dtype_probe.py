"""--dtype auto's start-up measurement (runner/cpu/dtype_probe.py) where the dtype table has no row
for the CPU: the model's linears timed in both dtypes, the verdict cached per machine and
handed to resolution. The timing itself is replaced where a test needs a given verdict (a
2-vCPU box's speed is not under test); measure() runs for real on tiny shapes."""
from __future__ import annotations

import dataclasses
import json

import pytest

from kvstrata.config import ModelInfo, ServerArgs
from kvstrata.platform import Platform
from kvstrata.runner.cpu import dtype_probe
NO_ROW_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw")  # AVX-512, no bf16 ones
ENV = {"KVSTRATA_CPU_DTYPE_PROBE": "auto"}


def real_cpu(flags=NO_ROW_FLAGS, threads=2) -> Platform:
    """Not simulated: the probe runs only for the machine it is on."""
    return Platform("cpu", "test CPU", cpu_flags=frozenset(flags), cpu_threads=threads)


class FakeTimer:
    def __init__(self, ratios):
        self.ratios, self.calls = ratios, []

    def __call__(self, shapes, gemv=False):
        self.calls.append((shapes, gemv))
        return dict(self.ratios)


def test_layer_shapes_follow_the_model_and_cap_wide_layers(tiny_checkpoints):
    dims = dtype_probe.model_dims(tiny_checkpoints["llama"])
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    assert dtype_probe.layer_shapes(dims) == [
        (q + 2 * kv, dims.hidden_size), (dims.hidden_size, q),
        (2 * dims.intermediate_size, dims.hidden_size), (dims.hidden_size,
                                                         dims.intermediate_size)]
    big = dataclasses.replace(dims, hidden_size=8192, intermediate_size=28672,
                              num_heads=64, num_kv_heads=8, head_dim=128)
    for n, k in dtype_probe.layer_shapes(big):
        assert n * k <= dtype_probe.MAX_WEIGHT and n % 64 == 0 and k in (8192, 28672)
    assert dtype_probe.model_dims("/no/such/model") is None


def test_measure_times_both_dtypes_at_every_row_count():
    ratios = dtype_probe.measure([(64, 32), (32, 64)], rows=(1, 4), rounds=2)
    assert set(ratios) == {1, 4} and all(r > 0 for r in ratios.values())


@pytest.mark.parametrize("ratios,want,said", [
    ({1: 1.9, 32: 1.04, 256: 1.06}, "bfloat16", "no slower at any and 1.28x over them"),
    ({1: 1.9, 32: 1.2, 256: 0.99}, "float32", "slower at some row count"),
    ({1: 1.06, 32: 1.02, 256: 1.03}, "float32", "only 1.04x over them (under 1.05x)"),
    ({1: 0.5, 32: 0.6, 256: 0.7}, "float32", "slower at some row count")])
def test_bf16_only_where_it_is_no_slower_anywhere_and_faster_overall(ratios, want, said):
    dtype, why = dtype_probe.verdict(ratios)
    assert dtype == want and why.endswith(said)
    assert f"{ratios[1]:.2f}x at 1 row, " in why and "at 256 rows of fp32's speed" in why


def test_measured_once_then_cached(tiny_checkpoints, tmp_path):
    args = ServerArgs(model_path=tiny_checkpoints["llama"])
    path = str(tmp_path / "probe.json")
    timer = FakeTimer({1: 2.0, 32: 1.3, 256: 1.1})
    plat = dtype_probe.measured_platform(args, real_cpu(), ModelInfo(), ENV, path, timer)
    dtype, why = plat.cpu_dtype_measured
    assert dtype == "bfloat16" and "2.00x at 1 row" in why and f"cached in {path}" in why
    assert len(timer.calls) == 1
    (record,) = json.load(open(path)).values()
    assert record["threads"] == 2 and record["ratios"] == {"1": 2.0, "32": 1.3, "256": 1.1}
    again = dtype_probe.measured_platform(args, real_cpu(), ModelInfo(), ENV, path, timer)
    assert len(timer.calls) == 1 and "as cached in" in again.cpu_dtype_measured[1]
    # another thread count (or kernel choice) is another machine for the probe
    dtype_probe.measured_platform(args, real_cpu(threads=4), ModelInfo(), ENV, path, timer)
    dtype_probe.measured_platform(args, real_cpu(), ModelInfo(),
                                  {**ENV, "KVSTRATA_CPU_BF16_GEMM": "own"}, path, timer)
    assert len(timer.calls) == 3 and len(json.load(open(path))) == 3


def test_no_measurement_where_the_table_decides_or_it_is_off(tiny_checkpoints, tmp_path):
    args = ServerArgs(model_path=tiny_checkpoints["llama"])
    timer, path = FakeTimer({1: 2.0, 32: 2.0, 256: 2.0}), str(tmp_path / "p.json")
    row = real_cpu(("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16"))
    cases = [(row, ENV, ModelInfo()), (real_cpu(), {"KVSTRATA_CPU_DTYPE_PROBE": "off"},
                                       ModelInfo()),
             (real_cpu(), {**ENV, "KVSTRATA_CPU_AUTO_DTYPE": "float32"}, ModelInfo()),
             (real_cpu(), ENV, ModelInfo(kv_pool_kind="mla")),
             (dataclasses.replace(real_cpu(), simulated=True), ENV, ModelInfo())]
    for plat, env, info in cases:
        assert dtype_probe.measured_platform(args, plat, info, env, path, timer) is plat
    assert not timer.calls
    on = dtype_probe.measured_platform(args, row, ModelInfo(),
                                       {"KVSTRATA_CPU_DTYPE_PROBE": "on"}, path, timer)
    assert on.cpu_dtype_measured[0] == "bfloat16" and len(timer.calls) == 1


def test_unreadable_cache_measures_and_an_unwritable_one_still_answers(tiny_checkpoints,
                                                                       tmp_path):
    args = ServerArgs(model_path=tiny_checkpoints["llama"])
    bad = tmp_path / "probe.json"
    bad.write_text("{not json")
    timer = FakeTimer({1: 1.0, 32: 1.0, 256: 1.0})
    plat = dtype_probe.measured_platform(args, real_cpu(), ModelInfo(), ENV, str(bad), timer)
    assert plat.cpu_dtype_measured[0] == "float32" and len(json.load(open(bad))) == 1
    blocked = tmp_path / "file"
    blocked.write_text("")
    plat = dtype_probe.measured_platform(args, real_cpu(), ModelInfo(), ENV,
                                         str(blocked / "probe.json"), timer)
    assert plat.cpu_dtype_measured[0] == "float32"


def test_llm_takes_the_measured_dtype(tiny_checkpoints, monkeypatch, tmp_path):
    """LLM() on a CPU without a table row: the measurement (faked: bf16 wins) decides, and
    server_info's resolution says it was measured."""
    from kvstrata import LLM
    from kvstrata.entrypoints import engine_factory

    monkeypatch.delenv("KVSTRATA_CPU_AUTO_DTYPE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(engine_factory, "platform_for", lambda args: real_cpu())
    timer = FakeTimer({1: 2.0, 32: 1.5, 256: 1.2})
    monkeypatch.setattr(dtype_probe, "measure", timer)
    llm = LLM(model_path=tiny_checkpoints["llama"], skip_tokenizer_init=True,
              max_total_tokens=256)
    try:
        info = llm.server_info()
        (rule,) = [r for r in info["resolutions"] if r["field"] == "dtype"]
        assert rule["new"] == "bfloat16" and "measured on this CPU at start-up" in rule["reason"]
        assert str(tmp_path / "kvstrata" / "cpu_dtype_probe.json") in rule["reason"]
        assert len(timer.calls) == 1
        out = llm.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2,
                                                                "temperature": 0})
        assert len(out["output_ids"]) == 2
    finally:
        llm.shutdown()


def test_cache_key_names_this_machine():
    key = dtype_probe.cache_key([(64, 32)], False, 2, {})
    assert key == dtype_probe.cache_key([(64, 32)], False, 2, {})
    assert key != dtype_probe.cache_key([(64, 32)], True, 2, {})
    assert key != dtype_probe.cache_key([(64, 64)], False, 2, {})


def test_explain_shows_the_cached_verdict_and_never_measures(tiny_checkpoints, monkeypatch,
                                                             tmp_path, capsys):
    """`kvstrata config --explain` on this machine: the verdict serve cached, else the
    table's answer saying start-up measures it; explain itself never times anything."""
    from kvstrata import platform as platform_mod
    from kvstrata.entrypoints import cli

    monkeypatch.delenv("KVSTRATA_CPU_AUTO_DTYPE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(platform_mod, "current_platform", lambda: real_cpu())
    never = FakeTimer({})
    monkeypatch.setattr(dtype_probe, "measure", never)
    model = tiny_checkpoints["llama"]

    def explained():
        assert cli.main(["config", "--explain", "--json", "--model-path", model]) == 0
        (rule,) = [r for r in json.loads(capsys.readouterr().out)["resolutions"]
                   if r["field"] == "dtype"]
        return rule["new"], rule["reason"]

    dtype, why = explained()
    assert dtype == "float32" and "not measured yet" in why
    dtype_probe.measured_platform(ServerArgs(model_path=model), real_cpu(), ModelInfo(),
                                  None, None, FakeTimer({1: 2.0, 32: 1.5, 256: 1.2}))
    dtype, why = explained()
    assert dtype == "bfloat16" and "as cached in" in why and not never.calls


def test_the_command_line_measures_and_shows_the_table(tiny_checkpoints, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        assert dtype_probe.main(["--model", tiny_checkpoints["llama"], "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = json.loads(capsys.readouterr().out)
    assert out["threads"] == 1 and set(out["ratios"]) == {"1", "32", "256"}
    assert out["probe"][0] in ("float32", "bfloat16")
    assert out["table"]["rule"] == "platform.cpu_dtype"
