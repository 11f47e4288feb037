"""Loading a checkpoint for serving: weights, then --quantization (or, for float32 / bf16 on a
CPU, the packed linear layers: runner/cpu/packed_linear.py; a DeepSeek model's through
runner/models/deepseek_packed.py). --quantization gguf keeps a GGUF file's weights in
their blocks from the load on (runner/quant/gguf_linear.py); w8a8_int8 re-quantizes a GGUF
file's dequantized weights. Shared by the target model (runner/model_runner.py)
and a STANDALONE draft model (runner/spec/standalone.py). Also what the runner reads of the
loaded checkpoint: its end-of-sequence ids and a sliding window its attention ignores."""
from __future__ import annotations

import os
from typing import Any

import torch

from kvstrata import envs
from kvstrata.config.hf_quant import checkpoint_scheme, reconcile_flag
from kvstrata.config.model_source import (load_generation_eos, load_hf_config,
                                         resolve_model_path)
from kvstrata.runner.cpu import fixed_experts, packed_linear
from kvstrata.runner.models import deepseek_fixed, deepseek_packed, hybrid_fixed, hybrid_packed
from kvstrata.runner.models.decoder import is_llama_family
from kvstrata.runner.models.loader import load_model, quant_scheme
from kvstrata.runner.models.registry import architecture_name
from kvstrata.runner.quant import gguf_pinned
from kvstrata.runner.quant.hybrid_w8a8 import quantize_hybrid_model
from kvstrata.runner.quant.smoothing import calibration_token_ids
from kvstrata.config.rules.deterministic import PINNED_QUANTIZATIONS
from kvstrata.runner.quant.w8a8 import check_batch_invariant, quantize_model
from kvstrata.runner.models.deepseek_w8a8 import quantize_mla_model


def refuse_unsupported_features(args: Any) -> None:
    """Before anything loads: a target model class that does not run some serving features
    yet (its `UNSUPPORTED` flags: gpt-oss) is refused with those flags by name. `args`:
    ServerArgs (the flags as given). (A gpt-oss STANDALONE draft runs; quantizing one is
    refused by load_serving_model.)"""
    from kvstrata.runner.models.gpt_oss import UNSUPPORTED  # noqa: PLC0415

    refuse_quantization_mismatch(args.model_path, args.quantization)
    if _architecture_of(args.model_path) != "GptOssForCausalLM":
        return
    used = [flag for flag, on in (
        ("--quantization", args.quantization is not None),
        ("--load-format gguf", args.load_format == "gguf"))  # = --quantization gguf
        if on]
    assert set(used) <= set(UNSUPPORTED)
    if used:
        raise ValueError(f"GptOssForCausalLM (gpt-oss) is not supported with "
                         f"{', '.join(used)} yet; it runs without {', '.join(UNSUPPORTED)}")


def refuse_quantization_mismatch(model_path: str, quantization: str | None) -> None:
    """Before anything loads: --quantization against a local checkpoint's own scheme
    (config/hf_quant.py; SGLang's rule), and a scheme kvstrata does not build, by field."""
    path = os.path.expanduser(model_path)
    if os.path.isdir(path):
        reconcile_flag(checkpoint_scheme(path), quantization)


def _architecture_of(model_path: str) -> str | None:
    """config.json's architecture (read as JSON: no transformers, no weights), or a gpt-oss
    GGUF file's (from its header); None for other GGUF files, known short names and anything
    unreadable (the load reports those)."""
    import json  # noqa: PLC0415

    from kvstrata.config import gguf_gpt_oss  # noqa: PLC0415
    from kvstrata.config.gguf_header import read_metadata  # noqa: PLC0415

    gguf_file = os.path.expanduser(model_path)
    if os.path.isfile(gguf_file) and gguf_file.lower().endswith(".gguf"):
        arch = read_metadata(gguf_file, ["general.architecture"]).get("general.architecture")
        return gguf_gpt_oss.ARCHITECTURE if arch == gguf_gpt_oss.ARCH else None
    path = os.path.join(os.path.expanduser(model_path), "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError):
        return None
    archs = raw.get("architectures") or []
    return archs[0] if archs else ("GptOssForCausalLM" if raw.get("model_type") == "gpt_oss"
                                   else None)


def load_serving_model(model_path: str, dtype: str, device: torch.device,
                       quantization: str | None, quantization_flag: str = "--quantization",
                       tp_group: Any = None,
                       deterministic: bool = False) -> tuple[Any, Any, Any, dict]:
    """(model, model source, HF config, what quantization ran). The float weights are
    replaced once, here, before the KV pool is sized from what memory the weights leave.
    `tp_group` (a TPGroup of size > 1): this rank's share of the model (every rank runs
    this, and the calibration forward of --quantization, in step). deterministic
    (--enable-deterministic-inference): every linear on one kvstrata GEMM for all row
    counts (packed_linear.PackedLinear._init_fixed), whatever KVSTRATA_CPU_PACKED_LINEAR says;
    an MoE layer's router and experts too (fixed_experts.py); a DeepSeek model's MLA
    projections, absorbed heads and FFNs (deepseek_fixed.py); a recurrent hybrid's linears,
    conv, scan and activations (hybrid_fixed.py); weights kept packed (GGUF,
    GPTQ / AWQ / compressed-tensors) on the GGUF kernels, batch-invariant as they stand,
    and their float parts on that GEMM (runner/quant/gguf_pinned.py); an FP8 checkpoint's
    dequantized layers as a float model's."""
    source = resolve_model_path(model_path)
    hf_config = load_hf_config(source)
    scheme = quant_scheme(source)  # the checkpoint's own (GPTQ, AWQ, compressed-tensors, FP8)
    reconcile_flag(scheme, quantization, quantization_flag)
    if scheme is not None:
        if tp_group is not None and tp_group.size > 1:
            raise ValueError(f"--tp-size {tp_group.size} with a quantized checkpoint "
                             f"({scheme.describe()}) is not built")
        if scheme.is_int and torch.device(device).type != "cpu":
            raise ValueError(f"{scheme.describe()}: its packed layers are built for CPU only, "
                             f"not {torch.device(device).type}")
        quantization = None  # the checkpoint's scheme runs, not a quantization at load
    keep_quantized = quantization == "gguf"  # a GGUF's weights stay in their blocks
    if keep_quantized and source.kind != "gguf":
        raise ValueError(f"{quantization_flag} gguf: {source.display_name} is not a GGUF file")
    if tp_group is not None and tp_group.size > 1:
        from kvstrata.runner.parallel.tp_load import load_tp_shard  # noqa: PLC0415
        if keep_quantized:
            raise ValueError(f"--tp-size {tp_group.size} with {quantization_flag} gguf is not "
                             f"implemented yet; pass --load-format gguf_dequantize")
        model = load_tp_shard(source, hf_config, tp_group, dtype, device)
    else:
        model = load_model(source, hf_config, dtype, device, keep_quantized=keep_quantized)
    arch = architecture_name(hf_config)
    if deterministic and model.pool_kind == "mla" and tp_group is not None and tp_group.size > 1:
        raise NotImplementedError(f"not implemented yet: --enable-deterministic-inference on "
                                  f"{arch} (MLA) with --tp-size {tp_group.size}")
    if deterministic and quantization not in (None, *PINNED_QUANTIZATIONS):
        raise NotImplementedError(f"not implemented yet: --enable-deterministic-inference "
                                  f"with {quantization_flag} {quantization}")
    refused = getattr(model, "unsupported", ())  # a model class's own (hybrids: resolution too)
    if deterministic and "--enable-deterministic-inference" in refused:
        raise NotImplementedError(f"not implemented yet: --enable-deterministic-inference on "
                                  f"{arch}")
    if keep_quantized or (scheme is not None and scheme.is_int):
        info = model.gguf_info  # packed layers, from load_model
        if deterministic:  # their float parts on the fixed GEMM (the GGUF kernels are fixed)
            info = {**info, **gguf_pinned.pin_packed_model(model)}
        return model, source, hf_config, info
    if quantization is not None and getattr(model, "num_recurrent_layers", 0):
        if deterministic:  # (resolution refuses it first: rules/deterministic.py)
            raise NotImplementedError(f"not implemented yet: --enable-deterministic-inference "
                                      f"with {quantization_flag} {quantization} on {arch}")
        info = quantize_hybrid_model(model, quantization, hybrid_packed.weight_blocks(model))
        return model, source, hf_config, info
    if quantization is not None and not quantizable(model):
        # Gemma too: smoothing folds scales into norm weights that Gemma applies as 1 + w.
        raise ValueError(f"{quantization_flag} {quantization} supports the llama-family "
                         f"decoder, its MoE members and DeepSeek only, not {arch}")
    info: dict = {"quantization": None}
    if quantization is not None and model.pool_kind == "mla":  # DeepSeek: unsmoothed
        info = quantize_mla_model(model, quantization, fixed=deterministic)
        if deterministic:
            info["batch_invariant"] = check_batch_invariant(model, quantization_flag)
    elif quantization is not None:
        ids, smoothing = calibration_token_ids(
            source, getattr(model, "full_dims", model.dims).vocab_size)
        info = quantize_model(model, quantization, ids, smoothing, fixed=deterministic)
        if deterministic:
            info["batch_invariant"] = check_batch_invariant(model, quantization_flag)
    elif deterministic and model.pool_kind == "mla":  # DeepSeek: MLA / DSA, its MoE
        info = deepseek_fixed.pin_mla_model(model)
    elif deterministic and getattr(model, "num_recurrent_layers", 0):  # the hybrids
        info = hybrid_fixed.pin_hybrid_model(model)
    elif deterministic:
        info = packed_linear.pack_model(model, fixed=True)
        # MoE layers: the router, each expert and the shared experts too
        info["pinned_moe_layers"] = fixed_experts.pin_moe_layers(model)
    elif (getattr(model, "num_recurrent_layers", 0) and envs.KVSTRATA_CPU_PACKED_LINEAR.get()
          and hybrid_packed.available(model)):  # the hybrids: mixers, MLPs, experts, head
        info = hybrid_packed.pack_hybrid_model(model)
    elif (model.pool_kind == "mha" and getattr(model, "packable", True)
          and envs.KVSTRATA_CPU_PACKED_LINEAR.get() and packed_linear.available(model)):
        info = packed_linear.pack_model(model)
        # MoE blocks (moe_decoder.py, gpt-oss): the router and every expert too
        moe_layers = (fixed_experts.pack_moe_layers(model)
                      if envs.KVSTRATA_CPU_PACKED_EXPERTS.get() else 0)
        if moe_layers:
            info["packed_moe_layers"] = moe_layers
    elif (model.pool_kind == "mla" and envs.KVSTRATA_CPU_PACKED_LINEAR.get()
          and packed_linear.available(model)):  # DeepSeek: projections, heads, FFNs
        info = deepseek_packed.pack_mla_model(model)
    if scheme is not None:  # fp8: dequantized at load, float layers
        info = {**info, "quantization": scheme.method, "checkpoint_scheme": scheme.describe()}
    return model, source, hf_config, info


def unhonoured_window(model, hf_config) -> int | None:
    """A sliding window the config names that the model's attention does not apply (a
    model without `layer_windows`): sizing caps the context at it, which keeps such a
    model exact. A model that sets layer_windows (the llama family's decoder) hands its
    windows to the attention backend: no cap."""
    if hasattr(model, "layer_windows"):
        return None
    window = getattr(hf_config, "sliding_window", None)
    # qwen2/qwen3 configs carry a window but only use it when use_sliding_window is set.
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(window)


def quantizable(model: Any) -> bool:
    """--quantization w8a8_int8 is built for it: the llama-family decoder, its MoE members
    (moe_decoder.py: experts int8, routers float; runner/quant/w8a8.py) and DeepSeek's MLA
    models (runner/models/deepseek_w8a8.py)."""
    spec = getattr(model, "spec", None)
    return (is_llama_family(model) or model.pool_kind == "mla"
            or (spec is not None and spec.family == "moe"))


def eos_token_ids(source, hf_config) -> list[int]:
    """The checkpoint's end-of-sequence ids: generation_config.json's (an HF directory), then
    the model config's eos_token_id."""
    ids = load_generation_eos(source)
    eos = getattr(hf_config, "eos_token_id", None)
    for e in ([eos] if isinstance(eos, int) else list(eos or [])):
        if e not in ids:
            ids.append(int(e))
    return ids
