"""--dtype auto on a CPU (config/rules/platform_defaults.py): bf16 where the CPU has bf16
instructions (AMX on one bf16 GEMM alone up to 8 threads) or AVX2 + FMA + F16C without
AVX-512 (kvstrata's own bf16 kernels, measured at 1-2 threads), fp32 elsewhere and for what
is only measured in fp32; explicit dtypes and accelerators untouched. Flags come from the
(simulated) platform, never from this machine."""
from __future__ import annotations

import pytest

from kvstrata.config import ModelInfo, ServerArgs, resolve
from kvstrata.platform import read_cpu_flags, simulated

AVX2 = ("sse4_2", "avx", "avx2", "fma", "f16c")
AVX512_BF16 = AVX2 + ("avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")
AMX = AVX512_BF16 + ("amx_tile", "amx_bf16", "amx_int8")
AVX512_NO_BF16 = AVX2 + ("avx512f", "avx512bw", "avx512_vnni")  # oneDNN's bf16: not measured
AVX2_NE_CONVERT = AVX2 + ("avx_vnni", "avx_ne_convert")  # oneDNN may take bf16: not measured
AVX2_ROW = "avx2 + fma + f16c"


def dtype_of(flags, model_info=ModelInfo(), platform="cpu", env=None, threads=0, **kwargs):
    resolved, res = resolve(ServerArgs(**kwargs),
                            simulated(platform, cpu_flags=flags, cpu_threads=threads),
                            model_info, env=env or {})
    rule = next((r for r in res if r.field == "dtype"), None)
    return resolved.dtype, rule


@pytest.mark.parametrize("flags,want,flag", [(AMX, "bfloat16", "amx_bf16"),
                                             (AVX512_BF16, "bfloat16", "avx512_bf16"),
                                             (AVX2, "bfloat16", AVX2_ROW),
                                             (AVX2 + ("avx_vnni",), "bfloat16", AVX2_ROW),
                                             (AVX512_NO_BF16, "float32", None),
                                             (AVX2_NE_CONVERT, "float32", None),
                                             (("avx", "avx2", "fma"), "float32", None),
                                             (("sse4_2", "avx", "avx2"), "float32", None),
                                             ((), "float32", None)])
def test_auto_follows_the_cpu_flags(flags, want, flag):
    dtype, rule = dtype_of(flags)
    assert dtype == want
    assert rule.rule == "platform.cpu_dtype" and rule.old == "auto"
    if flag:
        assert f"the CPU has {flag}" in rule.reason and "measured" in rule.reason
    else:
        assert "no bf16 path measured faster" in rule.reason


@pytest.mark.parametrize("gemm", ["onednn", "own"])
@pytest.mark.parametrize("threads,want", [(0, "bfloat16"), (1, "bfloat16"), (2, "bfloat16"),
                                          (8, "bfloat16"), (9, "float32"), (16, "float32"),
                                          (64, "float32")])
def test_amx_bf16_on_one_gemm_holds_up_to_its_measured_threads(threads, want, gemm):
    """AMX on oneDNN's bf16 linears alone served bf16 2.35-2.42x fp32 at 2 threads but 0.80x
    at 16 (an H200 host's Xeon); on kvstrata's GEMM alone 0.92-1.10x at 16: with either
    choice, above AMX_BF16_MAX_THREADS the CPU keeps fp32, quantized or not, and says why;
    the AVX-512 BF16 row (no AMX) has no such bound; an unknown count (0) takes the row."""
    from kvstrata.config.rules.platform_defaults import AMX_BF16_MAX_THREADS

    assert AMX_BF16_MAX_THREADS == 8
    env = {"KVSTRATA_CPU_BF16_GEMM": gemm}
    for quantization in (None, "w8a8_int8"):
        dtype, rule = dtype_of(AMX, threads=threads, quantization=quantization, env=env)
        assert dtype == want, (threads, quantization)
        if want == "float32":
            assert (f"amx_bf16 but runs {threads} threads" in rule.reason
                    and f"KVSTRATA_CPU_BF16_GEMM={gemm}" in rule.reason
                    and "0.80x fp32 at 16 threads" in rule.reason), rule.reason
        else:
            assert "amx_bf16: AMX bf16 tiles: serving measured bf16 2.35" in rule.reason
    assert dtype_of(AVX512_BF16, threads=threads, env=env)[0] == "bfloat16"
    assert dtype_of(AMX, threads=threads, dtype="bfloat16", env=env)[0] == "bfloat16"


@pytest.mark.parametrize("gemm", [None, "auto", "own_decode", " Own_Decode "])
@pytest.mark.parametrize("threads", [0, 2, 8, 9, 16, 64])
def test_amx_bf16_on_both_gemms_holds_at_any_thread_count(threads, gemm):
    """With both bf16 layouts (the default on AMX: kvstrata's GEMM for decode rows, oneDNN's
    AMX tiles for prefill) bf16 served 1.83-2.15x fp32 at 16 threads: the row has no bound.
    w8a8 with bf16 activations was not measured there: a quantized model keeps the bound."""
    env = {} if gemm is None else {"KVSTRATA_CPU_BF16_GEMM": gemm}
    dtype, rule = dtype_of(AMX, threads=threads, env=env)
    assert dtype == "bfloat16", threads
    assert ("the CPU has amx_bf16: AMX bf16 tiles for prefill and kvstrata's bf16 GEMM"
            in rule.reason and "1.83-2.15x fp32 at 16 threads" in rule.reason)
    dtype, rule = dtype_of(AMX, threads=threads, quantization="w8a8_int8", env=env)
    assert dtype == ("bfloat16" if threads <= 8 else "float32"), threads
    assert ("w8a8_int8 is not measured in bf16 above 8 threads" in rule.reason) == \
        (threads > 8), rule.reason


@pytest.mark.parametrize("gemm,want", [("auto", "bfloat16"), (" Own ", "bfloat16"),
                                       ("onednn", "float32"), ("own_decode", "float32")])
def test_avx2_bf16_only_on_kvstratas_gemm(gemm, want):
    """On AVX2 bf16 is measured on kvstrata's own GEMM; a choice that puts bf16 linears on
    torch's bf16 F.linear there (onednn; own_decode above 64 rows) keeps fp32, saying so."""
    for quantization in (None, "w8a8_int8"):
        dtype, rule = dtype_of(AVX2, env={"KVSTRATA_CPU_BF16_GEMM": gemm},
                               quantization=quantization)
        assert dtype == want, (gemm, quantization)
        assert ("takes bf16 linears off kvstrata's GEMM" in rule.reason) == (want == "float32")


def test_explicit_dtype_is_kept():
    for dtype in ("float32", "bfloat16", "float16"):
        assert dtype_of(AMX, dtype=dtype) == (dtype, None)
        assert dtype_of(AVX2, dtype=dtype) == (dtype, None)


def test_quantized_models_follow_the_int8_kernel():
    """w8a8_int8 with VNNI quantises the model's own activations (runner/cpu/int8_linear.py):
    the bf16 rows apply. Without VNNI, or with that layer ablated, fbgemm takes fp32."""
    dtype, rule = dtype_of(AMX, quantization="w8a8_int8")
    assert dtype == "bfloat16" and "the CPU has amx_bf16" in rule.reason
    assert dtype_of(AVX512_BF16, quantization="w8a8_int8")[0] == "bfloat16"
    dtype, rule = dtype_of(AMX, env={"KVSTRATA_CPU_INT8_MM": False}, quantization="w8a8_int8")
    assert dtype == "float32" and "float32 activations" in rule.reason


def test_avx2_w8a8_in_bf16_only_on_the_measured_int8_tile():
    """Without VNNI, kvstrata's AVX2 int8 tile quantises bf16 activations: w8a8 in bf16 was
    measured there (1.02-1.04x its fp32). With AVX-VNNI the layer is oneDNN's, not measured in
    bf16: fp32, saying so; fbgemm's layer (KVSTRATA_CPU_INT8_GEMM=onednn) takes fp32."""
    dtype, rule = dtype_of(AVX2, quantization="w8a8_int8")
    assert dtype == "bfloat16" and f"the CPU has {AVX2_ROW}" in rule.reason
    dtype, rule = dtype_of(AVX2 + ("avx_vnni",), quantization="w8a8_int8")
    assert dtype == "float32" and "measured unquantized only" in rule.reason, rule.reason
    dtype, rule = dtype_of(AVX2, quantization="w8a8_int8", env={"KVSTRATA_CPU_INT8_GEMM":
                                                                "onednn"})
    assert dtype == "float32" and "float32 activations" in rule.reason


@pytest.mark.parametrize("threads,want", [(0, "bfloat16"), (1, "bfloat16"), (2, "bfloat16"),
                                          (3, "float32"), (16, "float32")])
def test_avx2_bf16_holds_up_to_its_measured_threads(threads, want):
    """The AVX2 row is measured on 2 vCPUs: more threads keep fp32 and say why (no
    KVSTRATA_CPU_BF16_GEMM choice lifts that bound); an unknown count takes the row."""
    from kvstrata.config.rules.platform_defaults import AVX2_BF16_MAX_THREADS

    assert AVX2_BF16_MAX_THREADS == 2
    for quantization in (None, "w8a8_int8"):
        dtype, rule = dtype_of(AVX2, threads=threads, quantization=quantization)
        assert dtype == want, (threads, quantization)
        if want == "float32":
            assert (f"the CPU has {AVX2_ROW} but runs {threads} threads (bf16 holds up to 2): "
                    "bf16 is measured at 1-2 threads only (--dtype bfloat16 takes it)"
                    ) in rule.reason, rule.reason
            # unquantized, start-up measures it (runner/cpu/dtype_probe.py)
            assert ("not measured yet" in rule.reason) is (quantization is None)
            assert "KVSTRATA_CPU_BF16_GEMM" not in rule.reason


def test_int8_own_gemm_choice_counts_as_kvstratas_layer():
    """KVSTRATA_CPU_INT8_GEMM=own (kvstrata's int8 GEMM forced) quantises the model's own
    activations as auto's does: without VNNI the AVX2 row applies (bf16), where fbgemm's
    layer (onednn) takes fp32 activations; over the row's threads the reason is the CPU's."""
    for gemm, fbgemm in (("own", False), ("auto", False), ("onednn", True)):
        env = {"KVSTRATA_CPU_INT8_GEMM": gemm}
        dtype, rule = dtype_of(AVX2, env=env, quantization="w8a8_int8")
        assert dtype == ("float32" if fbgemm else "bfloat16"), gemm
        assert ("float32 activations" in rule.reason) is fbgemm, gemm
        dtype, rule = dtype_of(AVX2, env=env, quantization="w8a8_int8", threads=8)
        assert dtype == "float32" and ("float32 activations" in rule.reason) is fbgemm, gemm


def test_non_mha_models_stay_fp32():
    dtype, rule = dtype_of(AMX, model_info=ModelInfo(kv_pool_kind="mla", uses_dsa=True))
    assert dtype == "float32" and "mla model" in rule.reason


@pytest.mark.parametrize("platform", ["cuda", "hip", "npu"])
def test_accelerators_keep_auto_for_the_loader(platform):
    """On an accelerator auto stays auto (the loader takes the checkpoint's half dtype)."""
    assert dtype_of(AMX, platform=platform) == ("auto", None)
    # ... unless the model runs on the host CPU there
    assert dtype_of(AMX, platform=platform, device="cpu")[0] == "bfloat16"


def test_env_sets_what_auto_means():
    dtype, rule = dtype_of(AMX, env={"KVSTRATA_CPU_AUTO_DTYPE": "float32"})
    assert dtype == "float32" and "KVSTRATA_CPU_AUTO_DTYPE=float32" in rule.reason
    assert dtype_of(AVX2, env={"KVSTRATA_CPU_AUTO_DTYPE": "bfloat16"})[0] == "bfloat16"
    with pytest.raises(ValueError, match="KVSTRATA_CPU_AUTO_DTYPE='int4'"):
        dtype_of(AMX, env={"KVSTRATA_CPU_AUTO_DTYPE": "int4"})


def test_read_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert read_cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert read_cpu_flags(str(tmp_path / "missing")) == frozenset()


# Where the table has no row (the fallback, or above a row's threads) serve and LLM() time the
# linears at start-up (runner/cpu/dtype_probe.py) and hand the verdict in as the platform's
# cpu_dtype_measured; these check which cases ask for it and that the rule takes it.
MEASURED = ("bfloat16", "measured on this CPU at start-up: bf16 wins")


def wants(flags, threads=2, env=None, **kwargs):
    from kvstrata.config.rules.platform_defaults import wants_probe

    return wants_probe(ServerArgs(**kwargs), simulated("cpu", cpu_flags=flags,
                                                       cpu_threads=threads),
                       ModelInfo(), env or {})


@pytest.mark.parametrize("flags,threads,want", [
    (AVX512_NO_BF16, 2, True), (AVX2_NE_CONVERT, 2, True), ((), 2, True),
    (AVX2, 4, True), (AMX, 16, False), (AVX2, 2, False), (AVX512_BF16, 64, False)])
def test_probe_only_where_no_row_decides(flags, threads, want):
    assert wants(flags, threads) is want
    assert wants(flags, threads, env={"KVSTRATA_CPU_DTYPE_PROBE": "on"}) is True
    assert wants(flags, threads, env={"KVSTRATA_CPU_DTYPE_PROBE": "off"}) is False


@pytest.mark.parametrize("kwargs", [dict(dtype="float32"), dict(quantization="w8a8_int8"),
                                    dict(tp_size=2), dict(disaggregation_mode="decode"),
                                    dict(device="cuda")])
def test_probe_never_for_explicit_dtypes_quantized_tp_or_pd(kwargs):
    env = {"KVSTRATA_CPU_DTYPE_PROBE": "on"}
    assert wants(AVX512_NO_BF16, env=env, **kwargs) is False
    assert wants(AVX512_NO_BF16, env={"KVSTRATA_CPU_AUTO_DTYPE": "float32"}) is False


def test_probe_never_for_non_mha_models():
    from kvstrata.config.rules.platform_defaults import wants_probe

    plat = simulated("cpu", cpu_flags=AVX512_NO_BF16)
    assert not wants_probe(ServerArgs(), plat, ModelInfo(kv_pool_kind="mla"), {})


def measured_dtype(flags, threads=2, env=None, **kwargs):
    plat = simulated("cpu", cpu_flags=flags, cpu_threads=threads)
    plat = __import__("dataclasses").replace(plat, cpu_dtype_measured=MEASURED)
    resolved, res = resolve(ServerArgs(**kwargs), plat, ModelInfo(), env=env or {})
    return resolved.dtype, next(r for r in res if r.field == "dtype").reason


def test_a_measured_verdict_decides_where_the_table_has_no_row():
    assert measured_dtype(AVX512_NO_BF16) == ("bfloat16", f"--dtype auto on CPU: {MEASURED[1]}")
    assert measured_dtype(AVX2, threads=4)[0] == "bfloat16"
    # a row decides: the measurement only with KVSTRATA_CPU_DTYPE_PROBE=on
    assert measured_dtype(AMX, threads=2)[1].endswith("(2026-12-02)")
    on = {"KVSTRATA_CPU_DTYPE_PROBE": "on"}
    assert measured_dtype(AMX, env=on) == ("bfloat16", f"--dtype auto on CPU: {MEASURED[1]}")
    # off, quantized, TP: the table's answer whatever was measured
    assert measured_dtype(AVX512_NO_BF16, env={"KVSTRATA_CPU_DTYPE_PROBE": "off"})[0] == \
        "float32"
    assert measured_dtype(AVX512_NO_BF16, quantization="w8a8_int8")[0] == "float32"


def test_unmeasured_open_cases_say_start_up_measures_them():
    _, rule = dtype_of(AVX512_NO_BF16)
    assert "not measured yet" in rule.reason and "KVSTRATA_CPU_DTYPE_PROBE" in rule.reason
    _, rule = dtype_of(AVX512_NO_BF16, env={"KVSTRATA_CPU_DTYPE_PROBE": "off"})
    assert "not measured yet" not in rule.reason
    with pytest.raises(ValueError, match="KVSTRATA_CPU_DTYPE_PROBE='sometimes'"):
        dtype_of(AVX512_NO_BF16, env={"KVSTRATA_CPU_DTYPE_PROBE": "sometimes"})


def test_probe_follows_the_device_not_the_platform_kind():
    from kvstrata.config.rules.platform_defaults import wants_probe

    gpu_box = simulated("cuda", cpu_flags=AVX512_NO_BF16, cpu_threads=2)
    assert wants_probe(ServerArgs(device="cpu"), gpu_box, ModelInfo(), {})
    assert not wants_probe(ServerArgs(), gpu_box, ModelInfo(), {})
