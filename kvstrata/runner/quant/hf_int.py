"""GPTQ / AWQ / compressed-tensors integer weights -> GGUF block rows (PackedRows).

Every 4-bit format here is "value = s * (q - z)" with an unsigned code q in 0..15 and one
(s, z) per group of input columns; GGUF's Q4_1 block of 32 is "value = q * d + m" with fp16
d and m. So each group (a multiple of 32 columns) becomes whole Q4_1 blocks with d = s and
m = -z * s, and one kernel family (runner/cpu/gguf_matmul.py) serves every format:
- d: s is an fp16 scale in GPTQ / AWQ (exact); a bf16 scale (compressed-tensors) converts
  exactly while it lies in fp16's normal range [2^-14, 65504] (bf16's 8-bit significand fits
  fp16's 11); a float32 scale rounds to fp16 (relative error <= 2^-11).
- m: z * s is exact in float32 (an 11-bit significand times z <= 16), then rounds once to
  fp16: |m - (-z * s)| <= 2^-11 * |z * s| (<= 2^-25 below fp16's normal range). For the
  symmetric zero z = 8 (GPTQ sym, compressed-tensors sym) -8 * s is exact: the blocks then
  reproduce s * (q - 8) bit for bit in float32. For any other zero the error per weight is at
  most 16 * 2^-11 * |s| < |s| / 128, under 1% of one quantization step.
8-bit formats are symmetric ("value = s * (q - 128)") and become Q8_0 blocks (int8 q - 128,
fp16 d = s): exact up to d's fp16 rounding above, whether the scale is per group (a
multiple of 32 columns) or per channel (every block of the row takes the same d).

Act-order (GPTQ desc_act, compressed-tensors actorder group): each column's group is g_idx;
the columns are sorted by group (stable) so groups become contiguous runs of whole blocks,
and PackedRows.input_perm records the order so x's columns are gathered to meet them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.runner.quant.packed_rows import PackedRows

BLOCK = 32  # values per Q4_1 / Q8_0 block
Q4_1, Q8_0 = 3, 8  # gguf.GGMLQuantizationType values (checked in tests against gguf)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i holds column AWQ_ORDER[i]


@dataclass
class IntWeight:
    """One linear's integer weight, output rows first: value[n, k] = scale[n, g] *
    (q[n, k] - zero[n, g]) with g = group[k]."""
    q: torch.Tensor       # int32 [N, K], unsigned codes 0 .. 2^bits - 1
    scale: torch.Tensor   # [N, G] float (fp16 / bf16 / float32 as stored)
    zero: torch.Tensor    # int32 [N, G], in the unsigned code domain
    group: torch.Tensor   # int64 [K]: each input column's group
    bits: int


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 / bits values each, value j in bits j*bits .. (GPTQ, AWQ before its
    reorder, compressed-tensors): unpacked along `dim` (0 or 1) into int32 codes."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        vals = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & mask
        return vals.reshape(packed.shape[0] * per, packed.shape[1])
    vals = (packed.unsqueeze(-1) >> shifts) & mask
    return vals.reshape(packed.shape[0], packed.shape[1] * per)


def contiguous_groups(cols: int, group_size: int) -> torch.Tensor:
    if group_size == -1:
        return torch.zeros(cols, dtype=torch.int64)
    return torch.arange(cols, dtype=torch.int64) // group_size


def gptq_weight(qweight, qzeros, scales, g_idx, bits: int, group_size: int,
                desc_act: bool, v1: bool) -> IntWeight:
    """GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K * bits / 32, N] packed along K,
    qzeros int32 [G, N * bits / 32] packed along N, scales [G, N], g_idx int32 [K].
    checkpoint_format gptq (v1) stores each zero minus one (its kernels add the one back:
    a stored 15 means 16); gptq_v2 stores the zero."""
    q = unpack_int32(qweight, bits, 0)                  # [K, N]
    zero = unpack_int32(qzeros, bits, 1)[:, :q.shape[1]]  # [G, N]
    if v1:
        zero = zero + 1
    k = q.shape[0]
    if desc_act:
        if g_idx is None:
            raise ValueError("desc_act is set but the checkpoint has no g_idx")
        group = g_idx.to(torch.int64)
    else:  # without act-order the kernels ignore g_idx: group k // group_size
        group = contiguous_groups(k, group_size)
    return IntWeight(q.t().contiguous(), scales.t().contiguous(), zero.t().contiguous(),
                     group, bits)


def awq_weight(qweight, qzeros, scales, group_size: int) -> IntWeight:
    """AutoAWQ GEMM: qweight int32 [K, N / 8] and qzeros [G, N / 8] packed along N with
    nibble i holding column AWQ_ORDER[i] of its 8; scales [G, N]."""
    def unpack(p: torch.Tensor) -> torch.Tensor:
        u = unpack_int32(p, 4, 1).view(p.shape[0], -1, 8)
        out = torch.empty_like(u)
        out[:, :, list(AWQ_ORDER)] = u
        return out.reshape(p.shape[0], -1)

    q, zero = unpack(qweight), unpack(qzeros)
    return IntWeight(q.t().contiguous(), scales.t().contiguous(), zero.t().contiguous(),
                     contiguous_groups(q.shape[0], group_size), 4)


def compressed_tensors_weight(parts: dict, bits: int, group_size: int, sym: bool,
                              desc_act: bool) -> IntWeight:
    """compressed-tensors: `weight_packed` int32 [N, ceil(K * bits / 32)] packed along K
    (codes = signed value + 2^(bits-1)) with `weight_shape` [N, K], or `weight` int8 [N, K]
    (int-quantized); `weight_scale` [N, G] / [N, 1] / [1]; `weight_zero_point` (asymmetric)
    signed, packed along N into int32 [ceil(N * bits / 32), G] (or int8 [N, G]);
    `weight_g_idx` [K] (actorder group). value = scale * (signed - zero_point)."""
    offset = 1 << (bits - 1)
    if "weight_packed" in parts:
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        q = unpack_int32(parts["weight_packed"], bits, 1)[:n, :k]
    else:
        w = parts["weight"]
        if w.dtype != torch.int8:
            raise ValueError(f"int-quantized weight must be int8, got {w.dtype}")
        q = w.to(torch.int32) + offset
        n, k = q.shape
    scale = parts["weight_scale"]
    scale = scale.reshape(1, 1) if scale.numel() == 1 else scale.reshape(n, -1)
    scale = scale.expand(n, scale.shape[1])
    zero = torch.full(scale.shape, offset, dtype=torch.int32)
    zp = parts.get("weight_zero_point")
    if not sym and zp is not None:
        if zp.dtype == torch.int32:  # packed along N, codes = signed + offset
            zp = unpack_int32(zp, bits, 0)[:n] - offset
        zero = zp.to(torch.int32).reshape(n, -1).expand(n, scale.shape[1]) + offset
    if desc_act and "weight_g_idx" in parts:
        group = parts["weight_g_idx"].to(torch.int64)
    else:
        group = contiguous_groups(k, group_size if scale.shape[1] > 1 else -1)
    return IntWeight(q.contiguous(), scale.contiguous(), zero.contiguous(), group, bits)


def step_error(s: torch.Tensor, d: torch.Tensor, z: torch.Tensor, m: torch.Tensor | None,
               bits: int) -> float:
    """The largest |blocks' value - checkpoint's value| of any weight, in units of its
    quantization step s: the fp16 d (and Q4_1's m) against the stored s (and -z * s). 0.0
    when the blocks are exact (fp16 scales, symmetric zeros)."""
    nz = s != 0
    if not bool(nz.any()):
        return 0.0
    codes = float((1 << bits) - 1) if m is not None else 128.0  # the largest |q| or |q - 128|
    err = codes * (d.float() - s).abs()
    if m is not None:
        err = err + (m.float() + z.float() * s).abs()
    return float((err[nz] / s[nz].abs()).max())


def to_packed_rows(w: IntWeight, name: str = "weight", errors: dict | None = None
                   ) -> PackedRows:
    """Q4_1 (4 bits) or Q8_0 (8 bits, zero 128) block rows of `w`, columns sorted by group
    where the groups are not already contiguous (input_perm). `errors["step_error"]` keeps
    the largest step_error seen (the loader warns when it is not 0)."""
    n, k = w.q.shape
    if k % BLOCK:
        raise ValueError(f"{name}: {k} input columns is not a multiple of the GGUF block of "
                         f"{BLOCK}")
    group = w.group
    perm = None
    if bool((group[1:] < group[:-1]).any()):
        perm = torch.sort(group, stable=True).indices
        group = group[perm]
    blocks = group.view(-1, BLOCK)
    if not bool((blocks == blocks[:, :1]).all()):
        raise ValueError(f"{name}: its groups do not fall into whole blocks of {BLOCK} "
                         f"input columns (act-order groups of uneven sizes): this layout "
                         f"cannot be kept in GGUF blocks")
    q = w.q if perm is None else w.q[:, perm]
    bg = blocks[:, 0]
    if int(bg.max()) >= w.scale.shape[1]:
        raise ValueError(f"{name}: g_idx names group {int(bg.max())}, the scales have "
                         f"{w.scale.shape[1]}")
    s = w.scale[:, bg].float()                     # [N, nb]
    z = w.zero[:, bg]
    d = s.to(torch.float16)
    nb = k // BLOCK
    q = q.view(n, nb, BLOCK)
    if w.bits == 4:
        m = (-(z.float() * s)).to(torch.float16)
        _note(errors, step_error(s, d, z, m, 4))
        qs = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
        raw = torch.cat([d.unsqueeze(-1).view(torch.uint8), m.unsqueeze(-1).view(torch.uint8),
                         qs], dim=-1)
        return PackedRows(Q4_1, raw.reshape(n, -1), k, perm)
    if w.bits == 8:
        if not bool((z == 128).all()):
            raise ValueError(f"{name}: an 8-bit zero point other than 128 (asymmetric int8) "
                             f"cannot be kept in Q8_0 blocks")
        _note(errors, step_error(s, d, z, None, 8))
        qs = (q - 128).to(torch.int8).view(torch.uint8)
        raw = torch.cat([d.unsqueeze(-1).view(torch.uint8), qs], dim=-1)
        return PackedRows(Q8_0, raw.reshape(n, -1), k, perm)
    raise ValueError(f"{name}: {w.bits}-bit weights are not built (4, 8)")


def _note(errors: dict | None, err: float) -> None:
    if errors is not None:
        errors["step_error"] = max(errors.get("step_error", 0.0), err)


__all__ = ["AWQ_ORDER", "IntWeight", "awq_weight", "compressed_tensors_weight",
           "contiguous_groups", "gptq_weight", "step_error", "to_packed_rows", "unpack_int32"]
