"""What a Hugging Face checkpoint says about its own quantization, and --quantization against it.

A quantized HF checkpoint names its scheme in config.json's `quantization_config` (older
AutoGPTQ releases: a separate quantize_config.json). SGLang's rule, kept here: the checkpoint
decides; --quantization may be left out or name the same method (or a kernel of it: the
`*_marlin` names pick GPU kernels, which on a CPU all mean the one packed-block path);
anything else is an error naming both. Pure Python (no torch): resolution and the loader
both read it.

Built (runner/quant/hf_int.py converts, runner/quant/hf_checkpoint.py assembles):
- gptq: bits 4 (any zero point) or 8 (symmetric), group size a multiple of 32 or -1
  (per channel), act-order (desc_act) through g_idx; checkpoint_format gptq (v1: zeros
  stored minus one) or gptq_v2.
- awq: bits 4, version GEMM, zero_point true, group size a multiple of 32.
- compressed-tensors: pack-quantized (int4 / int8 packed into int32) and int-quantized
  (int8) weights, group / channel / tensor scales, symmetric or (pack-quantized) not,
  actorder through weight_g_idx; weight-only (no input_activations).
- fp8: e4m3 weights with 2-D block scales (weight_scale_inv, e.g. 128 x 128: DeepSeek /
  Qwen FP8 releases) or one scale per tensor (weight_scale), dynamic activation scheme;
  dequantized to the model dtype at load (activations stay in the model dtype).
Everything else is refused by the field and value that asks for it.
"""
from __future__ import annotations

import json
import os

from kvstrata.config.hf_quant_ct import compressed_tensors_scheme
from kvstrata.config.hf_quant_scheme import HfQuantScheme, check_group_size, refuse  # noqa: F401
from kvstrata.config.server_args import QUANTIZATION_FROM_CHECKPOINT

# --quantization names that only select how a checkpoint's own scheme runs (SGLang's
# override rule: gptq checkpoint + gptq_marlin is the same weights on another kernel).
FLAG_ACCEPTS = {"gptq": ("gptq", "gptq_marlin", "marlin"),
                "awq": ("awq", "awq_marlin", "marlin"),
                "compressed-tensors": ("compressed-tensors",),
                "fp8": ("fp8",)}
CHECKPOINT_FLAGS = QUANTIZATION_FROM_CHECKPOINT
# quant_methods a model class reads itself (gpt-oss's MXFP4 experts): passed through.
MODEL_HANDLED = ("mxfp4",)
# The methods whose weights stay packed (runner/quant/hf_int.py); fp8 is dequantized at load.
PACKED_METHODS = ("gptq", "awq", "compressed-tensors")


def read_quant_config(model_dir: str) -> tuple[dict | None, str]:
    """(quantization_config dict or None, file it came from) of a local HF checkpoint."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh).get("quantization_config")
    except (OSError, ValueError):
        cfg = None
    if cfg:
        return cfg, "config.json"
    for name in ("quantize_config.json", "quant_config.json"):  # AutoGPTQ / AutoAWQ of old
        try:
            with open(os.path.join(model_dir, name), encoding="utf-8") as fh:
                return json.load(fh), name
        except (OSError, ValueError):
            continue
    return None, ""


def method_name(cfg: dict | None) -> str:
    """quant_method as kvstrata spells it ("" for none; AutoGPTQ's file has no such key)."""
    if not cfg:
        return ""
    method = str(cfg.get("quant_method") or ("gptq" if "desc_act" in cfg else "")).lower()
    return method.replace("compressed_tensors", "compressed-tensors")


def parse_scheme(cfg: dict | None, where: str = "config.json") -> HfQuantScheme | None:
    """The built scheme a quantization_config describes; None for none (or one the model
    class reads itself); ValueError naming the field for any other."""
    if not cfg:
        return None
    method = method_name(cfg)
    if method in MODEL_HANDLED:
        return None
    if method == "gptq":
        return _gptq(cfg, where)
    if method == "awq":
        return _awq(cfg, where)
    if method == "compressed-tensors":
        return compressed_tensors_scheme(cfg, where)
    if method == "fp8":
        return _fp8(cfg, where)
    raise refuse(where, "quant_method", method or None, "gptq, awq, compressed-tensors, fp8")


def _gptq(cfg: dict, where: str) -> HfQuantScheme:
    bits = int(cfg.get("bits", 4))
    sym = bool(cfg.get("sym", True))
    if bits not in (4, 8):
        raise refuse(where, "bits", bits, "4, 8")
    if bits == 8 and not sym:
        raise refuse(where, "sym", False, "int8 symmetric only (GGUF Q8_0 has no zero point)")
    fmt = str(cfg.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(where, "checkpoint_format", fmt, "gptq, gptq_v2")
    if cfg.get("is_marlin_format"):
        raise refuse(where, "is_marlin_format", True, "the plain GPTQ layout")
    if cfg.get("lm_head"):
        raise refuse(where, "lm_head", True, "a float lm_head")
    if cfg.get("dynamic"):  # GPTQModel's per-module bits / group_size overrides
        raise refuse(where, "dynamic", cfg["dynamic"], "one bits / group_size for every layer")
    group = check_group_size(where, "group_size", int(cfg.get("group_size", 128)))
    return HfQuantScheme("gptq", bits, group, sym, bool(cfg.get("desc_act", False)), fmt,
                         source=where)


def _awq(cfg: dict, where: str) -> HfQuantScheme:
    bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
    if bits != 4:
        raise refuse(where, "bits", bits, "4")
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse(where, "version", cfg.get("version"), "GEMM (AutoAWQ's packed layout)")
    if not cfg.get("zero_point", True):
        raise refuse(where, "zero_point", False, "true")
    group = check_group_size(where, "group_size", int(cfg.get("group_size",
                                                              cfg.get("q_group_size", 128))))
    return HfQuantScheme("awq", 4, group, False, False, "gemm", source=where)


def _fp8(cfg: dict, where: str) -> HfQuantScheme:
    fmt = str(cfg.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise refuse(where, "fmt", fmt, "e4m3")
    scheme = str(cfg.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise refuse(where, "activation_scheme", scheme, "dynamic (activations run in the "
                      "model dtype: weights are dequantized at load)")
    block = cfg.get("weight_block_size")
    if block is not None:
        if len(block) != 2 or min(int(b) for b in block) <= 0:
            raise refuse(where, "weight_block_size", block, "two positive sizes")
        block = (int(block[0]), int(block[1]))
    return HfQuantScheme("fp8", 8, -1, True, False, "", block, source=where)


def checkpoint_scheme(model_dir: str) -> HfQuantScheme | None:
    cfg, where = read_quant_config(model_dir)
    return parse_scheme(cfg, where)


def reconcile_flag(scheme: HfQuantScheme | None, flag_value: str | None,
                   flag_name: str = "--quantization") -> None:
    """SGLang's rule: the checkpoint's scheme decides; a --quantization that names another
    method is an error naming both; a checkpoint method asked of a float checkpoint is
    refused (kvstrata does not quantize to GPTQ / AWQ / FP8 at load)."""
    if flag_value is None:
        return
    if scheme is None:
        if flag_value in CHECKPOINT_FLAGS:
            raise ValueError(f"{flag_name} {flag_value}: the checkpoint has no "
                             f"quantization_config; {flag_value} serves checkpoints "
                             f"quantized so (quantizing a float checkpoint to {flag_value} at "
                             f"load is not built)")
        return
    if flag_value not in FLAG_ACCEPTS.get(scheme.method, ()):
        raise ValueError(f"Quantization method specified in the model config "
                         f"({scheme.method}) does not match the quantization method "
                         f"specified in the `quantization` argument ({flag_value}): "
                         f"{flag_name} {flag_value} against {scheme.source}'s "
                         f"quant_method {scheme.method}")


__all__ = ["CHECKPOINT_FLAGS", "FLAG_ACCEPTS", "PACKED_METHODS", "HfQuantScheme",
           "check_group_size", "checkpoint_scheme", "method_name", "parse_scheme",
           "read_quant_config", "reconcile_flag"]
