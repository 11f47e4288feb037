"""Deterministic inference's linear layers: one kvstrata GEMM for every row count.

A row's result from oneDNN's linear, from the fp32 GEMV (1-16 rows) or from the AMX / oneDNN
split above 64 rows depends on how many rows share the call (each picks its body, and so its
summation order, by the row count), so a token's bits depended on its batch and its prefill
chunk. kvstrata's bf16 GEMM and its fp32 GEMM (the bf16 GEMM's AVX2 tile over f32_gemv's
panels) sum each output over k in one order for any number of rows: a "fixed" PackedLinear
(packed_linear.PackedLinear._init_fixed) runs every row count on them
(tests/correctness/test_batch_invariance.py checks 1..64 rows and more).
"""
from __future__ import annotations

from typing import Any

import torch

from kvstrata.runner.cpu import _bf16_ops, f32_gemv
from kvstrata.runner.cpu.isa import cpu_has_avx2, isa_cap

# The dtypes packed_linear.py packs and fixed layers pin. bf16 too: oneDNN reorders a plain
# bf16 weight for its AVX-512 BF16 / AMX kernels on every F.linear call; packed once it
# measured 1.6-2.3x faster at decode shapes (M = 1-32) on an AMX box and equal at prefill
# shapes, bit-identical (fp16 is not measured, so not packed).
DTYPES = (torch.float32, torch.bfloat16)
# Or-ed into a fixed bf16 layer's ISA cap (bf16_gemm.c EVERY_ROW_COUNT). With AMX-BF16 the
# bf16 GEMM takes up to 4 rows on its AVX512-BF16 body and more on the AMX tiles, which sum k
# in steps of 32 (tests/correctness/test_batch_invariance.py failed on the emulated tiles);
# with this flag the tiles take every row count (a row padded into a 16-row tile), so a fixed
# layer keeps the AMX speed where the batch has rows to fill them (until 2026-12-07 a fixed
# layer stayed on the AVX512-BF16 body instead).
FIXED_EVERY_ROW_COUNT = 0x100

FIXED_F32_KERNEL = ("kvstrata fp32 GEMM at every row count (deterministic inference: the AVX2 "
                    "tile of runner/cpu/csrc/bf16_gemm_avx2.h over f32_gemv's panels)")


def fixed_f32(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """A fixed fp32 layer: the fp32 GEMM over its panels at any row count (a padded width
    cut back)."""
    if x.dtype is not torch.float32:
        x = x.float()
    out = f32_gemv.linear(x, layer.gemv, layer.gemv_bias, fixed=True)
    if out is None:
        raise RuntimeError("the fp32 GEMM did not take a fixed layer's rows (was the ISA "
                           "capped below AVX2 after packing?)")
    if layer.out_packed != layer.out_features:
        out = out[..., :layer.out_features].contiguous()
    return out


def fixed_unsupported(weight: torch.Tensor) -> str | None:
    """Why kvstrata's GEMMs cannot run this weight at every row count (None: they can)."""
    if weight.device.type != "cpu" or weight.dtype not in DTYPES:
        return (f"a {weight.dtype} weight on {weight.device}: batch-invariant GEMMs are "
                f"kvstrata's CPU kernels for float32 and bfloat16")
    if weight.shape[1] % 2:
        return f"a linear layer with an odd input width ({weight.shape[1]})"
    if weight.dtype == torch.bfloat16 and not _bf16_ops.kernel_isa(isa_cap()):
        return "kvstrata's bf16 GEMM needs AVX2 + FMA (or AVX512-BF16) on this CPU"
    if weight.dtype == torch.float32 and not (isa_cap() >= 1 and cpu_has_avx2()):
        return "kvstrata's fp32 GEMM needs AVX2 + FMA on this CPU"
    return None
