"""MXFP4 (OCP microscaling FP4) weights, dequantized at load: released gpt-oss checkpoints store
their experts so (`*_blocks` + `*_scales`, quantization_config.quant_method "mxfp4").

Format (as transformers' integrations/mxfp4.py reads it): a block of 32 values shares one
E8M0 scale byte s (the power of two 2^(s - 127)); each value is an E2M1 nibble (sign, 2
exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte, the low nibble first.
`blocks` [..., rows, G, 16] uint8 and `scales` [..., rows, G] uint8 hold rows of G*32 values;
the checkpoint keeps each expert's matrix as [out, in], the model wants [in, out]
(transformers' GptOssExperts layout), hence the final transpose.

Every dequantized value is an E2M1 value times a power of two: exact in float32, and exact in
bfloat16 unless the scale leaves its range (both share float32's exponent range), so computing
in float32 and rounding once gives transformers' values.
"""
from __future__ import annotations

import torch

# E2M1 code -> value; bit 3 is the sign.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _E2M1 + tuple(-v for v in _E2M1)
SCALE_BIAS = 127
BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [E, rows, G, 16] uint8, scales [E, rows, G] uint8 -> [E, G*32, rows] in `dtype`
    (the transposed matrices, contiguous)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales "
                         f"{tuple(scales.shape)} (blocks of {BLOCK} values, 2 per byte)")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    *lead, rows, groups, _ = blocks.shape
    out = torch.empty(*lead, groups * BLOCK, rows, dtype=dtype, device=blocks.device)
    # One expert (leading index) at a time: the int64 codes of a whole gpt-oss-20b layer would
    # take ~4 GiB, one expert's ~130 MiB.
    flat_blocks, flat_scales = blocks.reshape(-1, rows, groups, BLOCK // 2), \
        scales.reshape(-1, rows, groups)
    for e, (blk, sc) in enumerate(zip(flat_blocks, flat_scales)):
        codes = torch.stack((blk & 0x0F, blk >> 4), dim=-1).long()  # low nibble first
        values = lut[codes].flatten(-2)  # [rows, G, 32]
        # times 2^(s - 127): a power of two, no rounding in float32
        values = torch.ldexp(values, sc.to(torch.int32)[..., None] - SCALE_BIAS)
        out.view(-1, groups * BLOCK, rows)[e] = values.reshape(rows, -1).T
    return out

__all__ = ["E2M1_VALUES", "dequantize_mxfp4"]
