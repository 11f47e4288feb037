"""GGUF weights kept quantized: x @ W.T read straight from the file's packed blocks (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), for the loader's GGUF layers. Q5_0 / Q5_1 because a
Q4_K_M / Q5_K_M file stores the tensors whose rows are not whole 256-weight super-blocks in
them or Q8_0 (SmolLM2-135M's with 576 inputs: every one but down_proj).

Why: a 4-bit GGUF model dequantized at load takes 4x its file's memory in bf16 and streams 4x
the bytes per decoded token; batch-1 decode on a CPU is bound by those bytes.

Kernel (runner/cpu/csrc/gguf_ops.c, blocks in gguf_blocks_avx2.h; AVX2 + FMA + F16C, picked
at run time under KVSTRATA_CPU_ISA): each 32-weight group of a row is dequantized in
registers to exactly the fp32 values gguf.quants.dequantize gives, and multiplied with fp32
activations (bf16 x is widened first). Activations stay float (no 8-bit activation blocks as
llama.cpp uses): results are within fp32 accumulation error of the float64 product of
dequantize(w) and x. Per row count:
  - 1-2 rows (batch-1/2 decode): groups dequantized and multiplied from registers, the packed
    bytes read once;
  - 3+ rows (decode batches, prefill): in blocks of 64 rows, a thread dequantizes 4 output
    columns into an fp32 panel [4, K] in its L2 and multiplies tiles of 3 rows x 4 columns from
    it: one dequantization per 64 rows.
Every path sums each output in one order: one 8-lane fp32 accumulator, an FMA per 8 k in order,
then a fixed horizontal tree; each output is computed whole by one thread. So all paths are
batch invariant (issue 60): row i of a call is bit-identical whatever M and the thread count.

Without AVX2 + FMA + F16C (another architecture, or KVSTRATA_CPU_ISA=scalar) the same C
extension's portable body (csrc/gguf_blocks_scalar.h): the same weights, the same operations
and summation order in plain C (fmaf), so the same bits as the AVX2 body, batch-invariant too;
many times slower.

Measured: benchmarks/bench_gguf_linear.py, docs/benchmarks.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.runner.cpu import _gguf_ops
from kvstrata.runner.cpu.isa import isa_cap

# gguf.GGMLQuantizationType values: (bytes per block, weights per block)
BLOCKS = {2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32),
          12: (144, 256), 13: (176, 256), 14: (210, 256)}
SUPPORTED: frozenset[int] = frozenset(BLOCKS)
AVX2_KERNEL = ("kvstrata GGUF GEMM (AVX2 + FMA + F16C, in-register dequantization, "
               "runner/cpu/csrc/gguf_ops.c)")
FALLBACK_KERNEL = ("kvstrata GGUF GEMM, portable C body (no AVX2 + FMA + F16C; the AVX2 body's "
                   "bits, slowly: runner/cpu/csrc/gguf_blocks_scalar.h)")


def supported(qtype: int) -> bool:
    return int(qtype) in SUPPORTED


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes of one weight row of `cols` values (K) in this format."""
    block_bytes, block_values = _blocks(qtype)
    if cols <= 0 or cols % block_values:
        raise ValueError(f"GGUF type {int(qtype)}: {cols} columns is not a multiple of its "
                         f"block of {block_values}")
    return cols // block_values * block_bytes


def _blocks(qtype: int) -> tuple[int, int]:
    if not supported(qtype):
        raise ValueError(f"GGUF quantization type {int(qtype)} has no kvstrata kernel "
                         f"(supported: {sorted(SUPPORTED)})")
    return BLOCKS[int(qtype)]


@dataclass(frozen=True)
class PreparedWeight:
    """A GGUF weight's rows as the file stores them (uint8 [N, row_bytes], one row per output
    channel, its blocks along K), kept as they are: no repacking, nbytes is the raw size."""
    qtype: int
    raw: torch.Tensor  # uint8 [N, row_bytes], contiguous
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


def prepare(qtype: int, raw: torch.Tensor) -> PreparedWeight:
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError(f"GGUF weight rows must be uint8 [out, row_bytes], got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    block_bytes, block_values = _blocks(qtype)
    if raw.shape[1] % block_bytes or raw.shape[0] < 1 or raw.shape[1] == 0:
        raise ValueError(f"GGUF type {int(qtype)}: a row of {raw.shape[1]} bytes is not whole "
                         f"{block_bytes}-byte blocks")
    raw = raw.contiguous()
    return PreparedWeight(int(qtype), raw, raw.shape[0], raw.shape[1] // block_bytes * block_values)


def _own(cap: int | None = None) -> bool:
    return bool(_gguf_ops.has_avx2(isa_cap() if cap is None else cap))


def kernel_name() -> str:
    return AVX2_KERNEL if _own() else FALLBACK_KERNEL


def matmul(x: torch.Tensor, w: PreparedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 or bf16 -> x @ dequantize(w).T, fp32 [..., N] (into `out` if given:
    fp32 [M, N] whose rows may be strided, e.g. a column slice of a wider output)."""
    n = w.out_features
    if x.dim() != 2 and x.dim() >= 1:
        flat = matmul(x.reshape(-1, x.shape[-1]), w, None if out is None else out.view(-1, n))
        return flat.view(*x.shape[:-1], n) if out is None else out
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of in_features={w.in_features}")
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif (out.dtype != torch.float32 or tuple(out.shape) != (m, n)
          or (m > 1 and (out.stride(1) != 1 or out.stride(0) < n))
          or (m == 1 and n > 1 and out.stride(1) != 1)):
        raise ValueError(f"out must be float32 [{m}, {n}] with contiguous rows, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if m == 0:
        return out
    xf = x.to(torch.float32).contiguous()
    _gguf_ops.matmul(w.qtype, w.raw.data_ptr(), w.raw.shape[1], n, w.in_features,
                     xf.data_ptr(), m, out.data_ptr(), out.stride(0) if m > 1 else n,
                     torch.get_num_threads(), isa_cap())
    return out


def dequantize(w: PreparedWeight) -> torch.Tensor:
    """The weight as fp32 [N, K]: exactly gguf.quants.dequantize's values."""
    out = torch.empty(w.out_features, w.in_features, dtype=torch.float32)
    _gguf_ops.dequantize(w.qtype, w.raw.data_ptr(), w.raw.shape[1], w.out_features,
                         w.in_features, out.data_ptr(), torch.get_num_threads(), isa_cap())
    return out


__all__ = ["SUPPORTED", "PreparedWeight", "dequantize", "kernel_name", "matmul", "prepare",
           "row_bytes", "supported"]
