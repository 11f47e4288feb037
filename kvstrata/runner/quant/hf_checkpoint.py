"""The loader's side of quantized HF checkpoints: per-linear tensors in, one weight out.

A quantized linear `P` is stored as several tensors (GPTQ: P.qweight, P.qzeros, P.scales,
P.g_idx; AWQ: P.qweight, P.qzeros, P.scales; compressed-tensors: P.weight_packed /
P.weight, P.weight_scale, ...; FP8: P.weight, P.weight_scale_inv). `assemble` gathers each
linear's parts as the safetensors files yield them (a linear is complete once every part
the checkpoint holds for it has arrived, whichever shard it is in) and hands the model one
`(P.weight, value)`: integer schemes a PackedRows (runner/quant/hf_int.py, kept quantized),
FP8 the float32 dequantized matrix (the model rounds it to its dtype). Every other tensor
(biases, norms, embeddings, the layers a checkpoint leaves in float) passes through.
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch

from kvstrata.config.hf_quant import HfQuantScheme
from kvstrata.runner.quant import hf_int

# The tensor whose presence marks P as quantized, and every part P may have, per method.
MARKER = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_scale",
          "fp8": None}
PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"),
         "awq": ("qweight", "qzeros", "scales"),
         "compressed-tensors": ("weight_packed", "weight", "weight_scale",
                                "weight_zero_point", "weight_g_idx", "weight_shape"),
         "fp8": ("weight", "weight_scale_inv", "weight_scale")}
FP8_SCALES = ("weight_scale_inv", "weight_scale")
logger = logging.getLogger(__name__)


def quantized_parts(scheme: HfQuantScheme, names: Iterable[str]) -> dict[str, str]:
    """{tensor name: its linear's prefix} for every part of every quantized linear."""
    names = set(names)
    out: dict[str, str] = {}
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        marker = MARKER[scheme.method]
        if marker is None:  # fp8: a weight with a scale beside it
            if leaf not in FP8_SCALES:
                continue
        elif leaf != marker:
            continue
        for part in PARTS[scheme.method]:
            if f"{prefix}.{part}" in names:
                out[f"{prefix}.{part}"] = prefix
    return out


def assemble(scheme: HfQuantScheme, parts_of: dict[str, str],
             tensors: Iterator[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor | hf_int.PackedRows]]:
    """`tensors` with each quantized linear's parts (`parts_of`: quantized_parts of every
    name the checkpoint holds) replaced by its one converted weight."""
    expected: dict[str, int] = {}
    for prefix in parts_of.values():
        expected[prefix] = expected.get(prefix, 0) + 1
    pending: dict[str, dict[str, torch.Tensor]] = {}
    errors: dict[str, float] = {}
    for name, tensor in tensors:
        prefix = parts_of.get(name)
        if prefix is None:
            yield name, tensor
            continue
        got = pending.setdefault(prefix, {})
        got[name[len(prefix) + 1:]] = tensor
        if len(got) == expected[prefix]:
            del pending[prefix]
            yield f"{prefix}.weight", convert(scheme, got, f"{prefix}.weight", errors)
    if errors.get("step_error", 0.0) > 0.0:  # never a silent loss: say how large it is
        logger.warning("%s kept in GGUF blocks: their fp16 block scale and minimum round the "
                       "checkpoint's scales / zero points; each weight within %.2g of its "
                       "quantization step of the checkpoint's value (runner/quant/hf_int.py)",
                       scheme.describe(), errors["step_error"])
    if pending:  # a read_spec skipped some parts: the linear is not this model's
        missing = sorted(pending)[:4]
        raise ValueError(f"quantized linears with parts unread: {missing}")


def convert(scheme: HfQuantScheme, parts: dict[str, torch.Tensor], name: str,
            errors: dict | None = None):
    m = scheme.method
    try:
        if m == "fp8":
            return dequantize_fp8(parts, scheme.block, name)
        if m == "gptq":
            w = hf_int.gptq_weight(parts["qweight"], parts["qzeros"], parts["scales"],
                                   parts.get("g_idx"), scheme.bits, scheme.group_size,
                                   scheme.desc_act, scheme.checkpoint_format == "gptq")
        elif m == "awq":
            w = hf_int.awq_weight(parts["qweight"], parts["qzeros"], parts["scales"],
                                  scheme.group_size)
        else:
            w = hf_int.compressed_tensors_weight(parts, scheme.bits, scheme.group_size,
                                                 scheme.sym, scheme.desc_act)
    except KeyError as e:
        raise ValueError(f"{name}: the {m} checkpoint lacks its {e.args[0]!r} tensor") from None
    return hf_int.to_packed_rows(w, name, errors)


def dequantize_fp8(parts: dict[str, torch.Tensor], block: tuple[int, int] | None,
                   name: str) -> torch.Tensor:
    """float32 weight of an e4m3 matrix: w = weight * scale, the scale one per block of
    block[0] x block[1] (weight_scale_inv [ceil(N / bn), ceil(K / bk)]: DeepSeek's name
    for the factor that undoes the quantization) or one per tensor / output row."""
    w = parts["weight"]
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: fp8 checkpoint weight is {w.dtype}, not float8_e4m3fn")
    scale = parts.get("weight_scale_inv", parts.get("weight_scale")).float()
    n, k = w.shape
    if scale.numel() == 1 or (scale.dim() == 2 and scale.shape == (n, 1)):
        return w.float() * scale.reshape(-1, 1)
    if block is None:
        raise ValueError(f"{name}: block scales {tuple(scale.shape)} but the config has no "
                         f"weight_block_size")
    bn, bk = block
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"{name}: scale shape {tuple(scale.shape)} does not tile "
                         f"{(n, k)} in blocks of {bn} x {bk}")
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w.float() * full


__all__ = ["assemble", "convert", "dequantize_fp8", "quantized_parts"]
