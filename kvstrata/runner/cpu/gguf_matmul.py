"""GGUF weights kept quantized: x @ W.T read straight from the file's packed blocks (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), for the loader's GGUF layers. Q5_0 / Q5_1 because a
Q4_K_M / Q5_K_M file stores the tensors whose rows are not whole 256-weight super-blocks in
them or Q8_0 (SmolLM2-135M's with 576 inputs: every one but down_proj).

Why: a 4-bit GGUF model dequantized at load takes 4x its file's memory in bf16 and streams 4x
the bytes per decoded token; batch-1 decode on a CPU is bound by those bytes.

Kernels (runner/cpu/csrc/; AVX2 + FMA + F16C picked at run time under KVSTRATA_CPU_ISA):

`matmul_q8`, what the layers of a GGUF file run with KVSTRATA_GGUF_INT8_ACTIVATIONS=1
(opt-in: faster served at batch 1 only; gguf_q8_blocks.h, gguf_q8_run.h): llama.cpp's scheme, our code. Each row of x (bf16 widened to fp32 first) is
quantized once per call to 8-bit blocks of 32 (scale d = amax / 127, q = round(x / d)); each
32-weight group of a weight row is unpacked to its integer weights and dotted with a block in
integers (_mm256_maddubs_epi16 / _mm256_madd_epi16: eight exact int32 lane sums), then scaled
once per group in fp32 (w_scale * d, one FMA per lane; formats with a min add w_min * d *
sum(q) in lanes of their own). The result is x's 8-bit blocks times gguf's exact weights to
within fp32 rounding; the activation rounding costs ~0.1-0.3% of |x| @ |W| per matmul
(tests/correctness/test_gguf_q8_matmul.py; SmolLM2 Q4_1's perplexity ratio to the
dequantized model 0.995: test_smollm2_gguf_packed.py). One path for every row count, rows in
tiles of 4 per weight unpacking. The integer sums are exact and every fp32 step is per row and
per output in one order, each output computed whole by one thread: batch invariant (issue 60),
row i of a call bit-identical whatever M and the thread count. Faster than `matmul` at 1-2
rows, slower from ~8 rows (its per-group float work; docs/benchmarks.md).

`matmul` keeps x in fp32 (gguf_ops.c with gguf_blocks_avx2.h: each group dequantized in
registers to exactly gguf.quants.dequantize's fp32 values and multiplied by FMAs; 1-2 rows from
registers, 3+ through a per-thread fp32 panel [4, K] per 64 rows): within fp32 accumulation
error of dequantize(w) @ x, batch invariant too. What a GGUF file's layers run by default
(served SmolLM2 Q4_1: `matmul_q8` ran 1.13-1.30x it at batch 1, 0.51x at batch 32), and what a
quantized HF checkpoint's layers
(GPTQ / AWQ / compressed-tensors converted to GGUF rows) run: their tests bound them against
transformers' float product at a tolerance 8-bit activations were not re-derived for.

The K-quants (Q4_K, Q5_K, Q6_K: what a Q4_K_M / Q5_K_M file's 256-aligned tensors hold) take
llama.cpp's q8_K scheme instead (gguf_q8k_run.h, gguf_q8k_tiles.h): x quantized in super-blocks
of 256 (one d per 256 values, and each 32-group's sum of its ints), the weights' 6-bit
(Q4_K / Q5_K) or 8-bit (Q6_K) sub-block scales kept as integers and applied to the int16 pair
sums (vpmaddwd; vpdpwssd on VNNI), the mins through the group sums, so a super-block is one
int32 sum per lane and one fp32 FMA per row: no per-group float work. Exact integers, then
fixed fp32 steps: batch-invariant, the same bits on the AVX2, VNNI and portable bodies; the
coarser activation blocks cost ~1.3x the 32-block rounding error
(tests/correctness/test_gguf_q8k_matmul.py). KVSTRATA_GGUF_Q8_SUPERBLOCKS=0 (or
use_superblocks(False)) puts them back on the 32-block path (A/B: docs/benchmarks.md).

On a CPU with AVX-512 VNNI (KVSTRATA_CPU_ISA allowing avx512) `matmul_q8` takes the same tiles
with one `vpdpbusd` per group and row for the AVX2 body's `vpmaddubsw` + `vpmaddwd`
(gguf_q8_tiles.h, compiled once per instruction set): the same exact int32 lane sums, so the
same bits.

Without AVX2 + FMA + F16C (another architecture, or KVSTRATA_CPU_ISA=scalar) both run their
portable C bodies (gguf_q8_blocks.h's q8_dot_scalar, gguf_blocks_scalar.h): the same
operations and summation order in plain C (fmaf), so the same bits as the AVX2 bodies,
batch-invariant too; many times slower.

Threads: a call of 1-4 rows over 256 KiB of weights is split into chunks of output quads
that the caller and kvstrata's own worker threads claim (csrc/gguf_pool.h): the caller never
waits for a worker the OS has not scheduled (an OpenMP region's barrier does: on a shared
2-vCPU box at load 14 a batch-1 step of SmolLM2 ran 14x slower on OpenMP), and the
workers sleep 300 us after their last chunk instead of spinning for milliseconds beside the
server's other processes. Larger calls split over torch's OpenMP team, as the step's other
kernels do. Either way each output is computed whole by one thread: the same bits.
KVSTRATA_CPU_GGUF_POOL=0 puts every call on OpenMP (ablation).

Measured: benchmarks/bench_gguf_linear.py, docs/benchmarks.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata import envs
from kvstrata.runner.cpu import _gguf_ops
from kvstrata.runner.cpu.isa import isa_cap

_gguf_ops.use_pool(envs.KVSTRATA_CPU_GGUF_POOL.get())
_superblocks = [envs.KVSTRATA_GGUF_Q8_SUPERBLOCKS.get()]  # what the C module was last told
_gguf_ops.use_superblocks(_superblocks[0])
K_QUANTS: frozenset[int] = frozenset({12, 13, 14})  # Q4_K, Q5_K, Q6_K

# gguf.GGMLQuantizationType values: (bytes per block, weights per block)
BLOCKS = {2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32),
          12: (144, 256), 13: (176, 256), 14: (210, 256)}
SUPPORTED: frozenset[int] = frozenset(BLOCKS)
AVX2_KERNEL = ("kvstrata GGUF GEMM (AVX2 + FMA + F16C; float activations: in-register "
               "dequantization, runner/cpu/csrc/gguf_ops.c; 8-bit activations: integer dot "
               "products, gguf_q8_blocks.h; Q4_K / Q5_K / Q6_K on 256-value super-blocks with integer "
               "sub-block scales, gguf_q8k_run.h)")
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
    if not _own():
        return FALLBACK_KERNEL
    return AVX2_KERNEL + ("; 8-bit activations on AVX-512 VNNI here" if has_vnni() else "")


def has_vnni(cap: int | None = None) -> bool:
    """Whether matmul_q8 runs its AVX-512 VNNI body here (the AVX2 body's bits)."""
    return bool(_gguf_ops.has_vnni(isa_cap() if cap is None else cap))


def matmul(x: torch.Tensor, w: PreparedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 or bf16 -> x @ dequantize(w).T with x kept float, fp32 [..., N] (into
    `out` if given: fp32 [M, N] whose rows may be strided, e.g. a column slice of a wider
    output): within fp32 accumulation error of the exact product (module docstring)."""
    return _call(_gguf_ops.matmul, x, w, out)


def matmul_q8(x: torch.Tensor, w: PreparedWeight,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """As matmul, with x's rows quantized to 8-bit blocks of 32 and integer dot products:
    faster at batch 1, ~0.1-0.2% of |x| @ |W| off the float product (module docstring)."""
    return _call(_gguf_ops.matmul_q8, x, w, out)


def _call(kernel, x: torch.Tensor, w: PreparedWeight, out: torch.Tensor | None) -> torch.Tensor:
    n = w.out_features
    if x.dim() != 2 and x.dim() >= 1:
        flat = _call(kernel, x.reshape(-1, x.shape[-1]), w,
                     None if out is None else out.view(-1, n))
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
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    kernel(w.qtype, w.raw.data_ptr(), w.raw.shape[1], n, w.in_features, xf.data_ptr(), m,
           out.data_ptr(), out.stride(0) if m > 1 else n, torch.get_num_threads(), isa_cap())
    return out


def bound_call(x: torch.Tensor, w: PreparedWeight, out: torch.Tensor, col: int, threads: int,
               cap: int, int8_activations: bool) -> tuple:
    """(kernel, arguments) for x [M, K] fp32 -> columns col..col + N of out (fp32 [M, >= col +
    N], rows contiguous), pointers taken once: what a decode plan replays every step
    (runner/models/decode_plan.py) without matmul's per-call checks and allocations. The
    caller keeps x, w and out alive and unmoved; the call computes what matmul (or
    matmul_q8) would on the same tensors, bit for bit."""
    m, n = x.shape[0], w.out_features
    if (x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2
            or x.shape[1] != w.in_features or out.dtype != torch.float32 or out.dim() != 2
            or out.shape[0] != m or out.stride(1) != 1 or out.shape[1] < col + n):
        raise ValueError(f"bound_call: x {x.dtype} {tuple(x.shape)} / out {out.dtype} "
                         f"{tuple(out.shape)} do not fit a weight [{n}, {w.in_features}] at "
                         f"column {col}")
    kernel = _gguf_ops.matmul_q8 if int8_activations else _gguf_ops.matmul
    return kernel, (w.qtype, w.raw.data_ptr(), w.raw.shape[1], n, w.in_features, x.data_ptr(),
                    m, out.data_ptr() + 4 * col, out.stride(0), threads, cap)


def use_superblocks(on: bool) -> None:
    """Whether matmul_q8 runs Q4_K / Q5_K / Q6_K on 256-value activation super-blocks with
    integer sub-block scales (the default, KVSTRATA_GGUF_Q8_SUPERBLOCKS) or on the 32-value
    blocks of the other formats: process-wide, for tests and A/B benchmarks."""
    _superblocks[0] = bool(on)
    _gguf_ops.use_superblocks(_superblocks[0])


def activation_blocks(qtypes) -> str:
    """How matmul_q8 quantizes x for weights of these formats, as /server_info reports it."""
    if _superblocks[0] and K_QUANTS & {int(q) for q in qtypes}:
        return "int8 blocks of 32; Q4_K / Q5_K / Q6_K: super-blocks of 256"
    return "int8 blocks of 32"


def dequantize(w: PreparedWeight) -> torch.Tensor:
    """The weight as fp32 [N, K]: exactly gguf.quants.dequantize's values."""
    out = torch.empty(w.out_features, w.in_features, dtype=torch.float32)
    _gguf_ops.dequantize(w.qtype, w.raw.data_ptr(), w.raw.shape[1], w.out_features,
                         w.in_features, out.data_ptr(), torch.get_num_threads(), isa_cap())
    return out


__all__ = ["K_QUANTS", "SUPPORTED", "PreparedWeight", "activation_blocks", "bound_call", "dequantize", "has_vnni", "kernel_name",
           "matmul", "matmul_q8", "prepare", "row_bytes", "supported",
           "use_superblocks"]
