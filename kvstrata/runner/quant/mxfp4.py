"""MXFP4 (OCP microscaling FP4) weights, dequantized at load: released gpt-oss checkpoints store
their experts so (`*_blocks` + `*_scales`, quantization_config.quant_method "mxfp4").

Format (as transformers' integrations/mxfp4.py reads it): a block of 32 values shares one
E8M0 scale byte s (the power of two 2^(s - 127)); each value is an E2M1 nibble (sign, 2
exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte, the low nibble first.
`blocks` [..., rows, G, 16] uint8 and `scales` [..., rows, G] uint8 hold rows of G*32 values;
the checkpoint keeps each expert's matrix as [out, in], the model wants [in, out]
(transformers' GptOssExperts layout), hence the final transpose.

GGUF files (llama.cpp's GGML type MXFP4, 39) hold the same values in ggml's block_mxfp4: the
scale byte first, then 16 bytes whose low nibbles are values 0..15 and high nibbles 16..31
(`dequantize_ggml_mxfp4`).

Every dequantized value is an E2M1 value times a power of two: exact in float32, and exact in
bfloat16 unless the scale leaves its range (both share float32's exponent range), so computing
in float32 and rounding once gives transformers' values.
"""
from __future__ import annotations

import numpy as np
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


GGML_BLOCK_BYTES = 1 + BLOCK // 2
# ggml's kvalues_mxfp4: the E2M1 values doubled, as int8 (so code 8, "-0", is +0.0), the
# scale halved to match
_GGML_KVALUES = np.array([2 * v for v in E2M1_VALUES], dtype=np.int8).astype(np.float32)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml_e8m0_to_fp32_half: 2^(e - 128) as float32 bits (e < 2: the subnormals)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def dequantize_ggml_mxfp4(data: np.ndarray) -> np.ndarray:
    """GGUF MXFP4 rows (uint8 [..., n_blocks * 17], as gguf_index.py hands them out) -> float32
    [..., n_blocks * 32]: ggml's dequantize_row_mxfp4, bit for bit (d * kvalue: both exact).
    _ROWS rows at a time, so the temporaries of a whole expert tensor stay small."""
    if data.dtype != np.uint8 or data.shape[-1] % GGML_BLOCK_BYTES:
        raise ValueError(f"GGUF MXFP4 rows are uint8 blocks of {GGML_BLOCK_BYTES} bytes, got "
                         f"{data.dtype} {tuple(data.shape)}")
    width = data.shape[-1] // GGML_BLOCK_BYTES * BLOCK
    rows = data.reshape(-1, data.shape[-1])
    out = np.empty((rows.shape[0], width), dtype=np.float32)
    for lo in range(0, rows.shape[0], _ROWS):
        blocks = rows[lo:lo + _ROWS].reshape(-1, GGML_BLOCK_BYTES)
        qs = blocks[:, 1:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # values 0..15, then 16..31
        with np.errstate(over="ignore"):  # scale 255 times 12: inf, as ggml computes it
            values = _e8m0_half(blocks[:, :1]) * _GGML_KVALUES[codes]
        out[lo:lo + _ROWS] = values.reshape(-1, width)
    return out.reshape(*data.shape[:-1], width)


_ROWS = 4096


__all__ = ["E2M1_VALUES", "GGML_BLOCK_BYTES", "dequantize_ggml_mxfp4", "dequantize_mxfp4"]
