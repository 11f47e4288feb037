"""config/hf_quant.py: a checkpoint's quantization_config -> the built scheme, refusals by
field, and --quantization against the checkpoint (SGLang's rule)."""
from __future__ import annotations

import json

import pytest

from kvstrata.config.hf_quant import (CHECKPOINT_FLAGS, checkpoint_scheme, parse_scheme,
                                      reconcile_flag)
from kvstrata.config.server_args import QUANTIZATION_BUILT, QUANTIZATIONS

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True,
        "checkpoint_format": "gptq"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "version": "gemm"}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
       "weight_block_size": [128, 128]}


def _ct(weights: dict, fmt: str = "pack-quantized", **group) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, **group}}}


W4A16 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
         "group_size": 128, "dynamic": False, "actorder": None}


def test_built_schemes():
    s = parse_scheme(GPTQ)
    assert (s.method, s.bits, s.group_size, s.desc_act, s.checkpoint_format) == \
        ("gptq", 4, 128, True, "gptq")
    assert parse_scheme({**GPTQ, "checkpoint_format": "gptq_v2"}).checkpoint_format == "gptq_v2"
    assert parse_scheme({**GPTQ, "bits": 8}).bits == 8
    assert parse_scheme({**GPTQ, "group_size": -1}).group_size == -1
    assert parse_scheme({**AWQ, "version": "GEMM"}).method == "awq"
    assert parse_scheme(FP8).block == (128, 128)
    ct = parse_scheme(_ct(W4A16))
    assert (ct.method, ct.bits, ct.group_size, ct.sym) == ("compressed-tensors", 4, 128, True)
    w8 = parse_scheme(_ct({**W4A16, "num_bits": 8, "strategy": "channel"}, "int-quantized"))
    assert (w8.bits, w8.group_size, w8.checkpoint_format) == (8, -1, "int-quantized")
    assert parse_scheme(_ct({**W4A16, "actorder": "group"})).desc_act
    assert parse_scheme({"quant_method": "mxfp4"}) is None  # gpt-oss reads its own
    assert parse_scheme(None) is None


@pytest.mark.parametrize("cfg,field", [
    ({**GPTQ, "bits": 3}, "bits = 3"),
    ({**GPTQ, "bits": 8, "sym": False}, "sym = False"),
    ({**GPTQ, "group_size": 16}, "group_size = 16"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format = 'marlin'"),
    ({**GPTQ, "lm_head": True}, "lm_head = True"),
    ({**GPTQ, "dynamic": {r"+:.*\.down_proj": {"bits": 8}}}, "dynamic = "),
    ({**AWQ, "version": "gemv"}, "version = 'gemv'"),
    ({**AWQ, "version": "gemv_fast"}, "version = 'gemv_fast'"),
    ({**AWQ, "zero_point": False}, "zero_point = False"),
    ({**AWQ, "bits": 8}, "bits = 8"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme = 'static'"),
    ({**FP8, "fmt": "e5m2"}, "fmt = 'e5m2'"),
    ({"quant_method": "bitsandbytes"}, "quant_method = 'bitsandbytes'"),
    (_ct(W4A16, input_activations={"num_bits": 8, "type": "int", "dynamic": True}),
     "config_groups.group_0.input_activations"),
    (_ct({**W4A16, "type": "float", "num_bits": 8}), "weights.type = 'float'"),
    (_ct({**W4A16, "num_bits": 2}), "weights.num_bits = 2"),
    (_ct({**W4A16, "strategy": "block"}), "weights.strategy = 'block'"),
    (_ct({**W4A16, "num_bits": 8, "symmetric": False}), "weights.symmetric = False"),
    (_ct(W4A16, "marlin-24"), "format = 'marlin-24'"),
    (_ct(W4A16, "float-quantized"), "format = 'float-quantized'"),
])
def test_refused_by_field(cfg, field):
    with pytest.raises(ValueError, match=f"quantization_config.*{field}"):
        parse_scheme(cfg)


def test_flag_against_checkpoint():
    gptq, awq = parse_scheme(GPTQ), parse_scheme(AWQ)
    for flag in (None, "gptq", "gptq_marlin", "marlin"):
        reconcile_flag(gptq, flag)
    for flag in (None, "awq", "awq_marlin", "marlin"):
        reconcile_flag(awq, flag)
    with pytest.raises(ValueError, match=r"model config \(gptq\).*argument \(awq\)"):
        reconcile_flag(gptq, "awq")
    with pytest.raises(ValueError, match=r"model config \(awq\).*\(w8a8_int8\)"):
        reconcile_flag(awq, "w8a8_int8")
    with pytest.raises(ValueError, match="--quantization fp8: the checkpoint has no "
                                         "quantization_config"):
        reconcile_flag(None, "fp8")
    reconcile_flag(None, "w8a8_int8")  # quantized at load


def test_flags_are_sglang_names_and_built():
    assert set(CHECKPOINT_FLAGS) <= set(QUANTIZATIONS)
    assert set(CHECKPOINT_FLAGS) <= set(QUANTIZATION_BUILT)


def test_reads_config_json_or_quantize_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_scheme(str(tmp_path)) is None
    legacy = {k: v for k, v in GPTQ.items() if k != "quant_method"}  # AutoGPTQ's own file
    (tmp_path / "quantize_config.json").write_text(json.dumps(legacy))
    scheme = checkpoint_scheme(str(tmp_path))
    assert scheme.method == "gptq" and scheme.source == "quantize_config.json"


def test_resolution_knows_the_checkpoint_scheme(tmp_path):
    """ModelInfo.from_model_path reads the scheme (config.json, or AutoGPTQ's own file): --dtype
    auto keeps float32 for the packed layers (not measured in bf16) and deterministic
    inference stays off where it would be on by default (the load refuses it)."""
    from kvstrata.config import ModelInfo, resolve
    from kvstrata.config.server_args import ServerArgs
    from kvstrata.platform import simulated

    avx2 = simulated("cpu", cpu_flags=("avx2", "fma", "f16c"), cpu_threads=2)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    resolved, _ = resolve(ServerArgs(), avx2, ModelInfo.from_model_path(str(tmp_path)), env={})
    assert (resolved.dtype, resolved.enable_deterministic_inference) == ("bfloat16", True)
    legacy = {k: v for k, v in GPTQ.items() if k != "quant_method"}
    (tmp_path / "quantize_config.json").write_text(json.dumps(legacy))
    info = ModelInfo.from_model_path(str(tmp_path))
    assert info.quant_method == "gptq"
    resolved, res = resolve(ServerArgs(), avx2, info, env={})
    assert (resolved.dtype, resolved.enable_deterministic_inference) == ("float32", False)
    assert "gptq checkpoint" in {r.field: r for r in res}["dtype"].reason
    fp8 = ModelInfo.from_hf_config({"model_type": "qwen3", "quantization_config": FP8})
    assert fp8.quant_method == "fp8"  # dequantized at load: a float model's dtype rules
    resolved, _ = resolve(ServerArgs(), avx2, fp8, env={})
    assert (resolved.dtype, resolved.enable_deterministic_inference) == ("bfloat16", False)
