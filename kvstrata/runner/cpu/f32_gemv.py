"""fp32 linear layers for 1-16 rows (a decode step at batch 1-16) on the CPU: kvstrata's GEMV
(csrc/f32_gemv.h, in the `_cpu_ops` extension) over a second copy of each weight, packed in
panels of 16 output columns.

Why: at batch 1 a decode step streams every weight once (2 flops per 4 bytes), so its speed
is the weights' bandwidth. oneDNN's prepacked fp32 linear (packed_linear.py, the layout that
runs prefill and large batches at the GEMM peak) streamed SmolLM2's layer weights at 13-21
GB/s on a 2-vCPU AVX2 EPYC, and slower per byte at 2-4 rows than at 1, where a plain read of
the same bytes ran 26-36 GB/s; this GEMV reads them at 21-36 GB/s: 1.2-2.4x oneDNN's speed
per layer at 1-4 rows, 1.1-1.5x at 6-8 (benchmarks/bench_gemv.py), 1.13-1.29x at 10-16 (on
an AVX2-only CPU the GEMV takes up to 16 rows: max_rows()). More rows (from about there the
GEMMs are no longer bound by the weights' bytes) keep oneDNN's layout on an AVX-512 CPU; on a
CPU without AVX-512 they take kvstrata's fp32 GEMM over the same panels (gemm_above(): the
bf16 GEMM's AVX2 tile, whose widened bf16 panels have this layout, reading the fp32 weights
as they are).

The cost is memory: the layers' fp32 weights are held twice (SmolLM2: +424 MB). So `auto`
(KVSTRATA_CPU_F32_GEMV) keeps the copies only on a CPU with AVX2 + FMA and when they take at
most COPY_RAM_FRACTION of the machine's RAM; the bytes count as weights (the KV pool sizing
sees them); `off` never makes them. The output head keeps oneDNN's layout (its 113 MB
stream ran ~28 GB/s there already). Results differ from F.linear's by summation order only.
"""
from __future__ import annotations

import functools

import torch

from kvstrata import envs
from kvstrata.kv.host_pool import total_ram_bytes
from kvstrata.runner.cpu import _bf16_ops, _cpu_ops
from kvstrata.runner.cpu.isa import cpu_has_avx2, isa_cap

KERNEL = "kvstrata fp32 GEMV at 1-16 rows (AVX2 + FMA, runner/cpu/csrc/f32_gemv.h)"
MAX_ROWS = 16  # the kernel's limit; max_rows() is the dispatch's
# Measured on the 2-vCPU AVX2 EPYC (benchmarks/bench_gemv.py, SmolLM2's 120 layer linears,
# 2 threads): the GEMV ran 1.27-1.29x oneDNN's prepacked layer at 10 rows, 1.15-1.19x at
# 12, 1.13x at 16, 1.02-1.04x at 20-24 and 0.87x at 32. oneDNN's fp32 on an AVX-512 CPU has
# twice the vector width there and was only measured against the GEMV up to 8 rows.
AVX512_MAX_ROWS = 8
PANEL = 16
CHOICES = ("auto", "gemv", "off")
# The fp32 GEMM takes max_rows()+1 .. GEMM_MAX_ROWS rows (decode batches; a prefill's rows
# stay oneDNN's). Measured on the 2-vCPU AVX2 EPYC: per layer (bench_gemv.py --rows, weights
# streaming) 1.01-1.44x oneDNN's at 24-128 rows, 0.94-1.07x at 256-1024; whole SmolLM2
# decode steps (--model smollm2-135m --gemm-ab, two runs) batch 17 1.24x, 24 1.05 / 1.10x,
# 32 1.22 / 1.16x, 48 1.25x, 64 1.10 / 0.97x, 128 0.96x; a served run's prefill (1000-2048-row
# steps) 0.97x.
GEMM_MAX_ROWS = 64
GEMM_KERNEL = ("kvstrata fp32 GEMM at 17-64 rows (the AVX2 tile of runner/cpu/csrc/"
               "bf16_gemm_avx2.h over the GEMV's panels)")
COPY_RAM_FRACTION = 1 / 8


def _vector_isa() -> bool:
    """The GEMV runs its AVX2 code: the CPU has it and KVSTRATA_CPU_ISA allows it."""
    return isa_cap() >= 1 and cpu_has_avx2()


@functools.lru_cache(maxsize=1)
def max_rows() -> int:
    """Rows up to which a linear takes the GEMV rather than oneDNN's layer: 16 on an AVX2-only
    CPU (measured), 8 where oneDNN has AVX-512 (not measured beyond)."""
    from kvstrata.platform import read_cpu_flags
    return AVX512_MAX_ROWS if "avx512f" in read_cpu_flags() else MAX_ROWS


def gemm_above() -> bool:
    """Whether layers with the copies also take kvstrata's fp32 GEMM over them for more rows
    than max_rows(), up to GEMM_MAX_ROWS (read when the weights are packed):
    KVSTRATA_CPU_F32_GEMV=auto on a CPU without AVX-512, where oneDNN's fp32 runs AVX2 code
    too. Measured there (SmolLM2's four layer shapes, 2 threads, benchmarks/bench_gemv.py
    --rows): 1.01-1.44x oneDNN's layer at 24-128 rows; decode steps 1.05-1.22x at batch
    24-64 (--model ... --gemm-ab). With AVX-512, oneDNN's fp32 has twice the vector width and
    keeps those rows."""
    from kvstrata.platform import read_cpu_flags
    return (envs.KVSTRATA_CPU_F32_GEMV.get().strip().lower() == "auto"
            and "avx512f" not in read_cpu_flags())


def fits(weight: torch.Tensor) -> bool:
    """The GEMV takes this weight's shape and dtype: fp32 [out, in] on the CPU, in even,
    out a multiple of 16."""
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.shape[1] % 2 == 0 and weight.shape[0] % PANEL == 0
            and weight.shape[0] >= PANEL)


def worth_copies(weights: list[torch.Tensor], ram_bytes: int | None = None) -> bool:
    """Whether to hold f32_gemv copies of these (a model's layer) weights: KVSTRATA_CPU_F32_GEMV
    is auto, the CPU runs the vector code, every weight fits, and the copies take at most
    COPY_RAM_FRACTION of RAM."""
    choice = envs.KVSTRATA_CPU_F32_GEMV.get().strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"KVSTRATA_CPU_F32_GEMV={choice!r} is not one of {CHOICES}")
    if choice == "off" or not weights or not all(fits(w) for w in weights) or not _vector_isa():
        return False
    extra = sum(w.numel() * 4 for w in weights)
    ram = ram_bytes if ram_bytes is not None else total_ram_bytes()
    return extra <= ram * COPY_RAM_FRACTION


def pack(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [n, k] -> f32_gemv.h's panels [n / 16][k][16] (a copy)."""
    n, k = weight.shape
    return weight.detach().reshape(n // PANEL, PANEL, k).permute(0, 2, 1).contiguous()


def unpack(panels: torch.Tensor) -> torch.Tensor:
    """pack's inverse: the plain [n, k] weight (a copy)."""
    np_, k, _ = panels.shape
    return panels.permute(0, 2, 1).reshape(np_ * PANEL, k)


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
           cap: int | None = None, gemm: bool = False,
           fixed: bool = False) -> torch.Tensor | None:
    """F.linear(x, W, bias) for x of 1-max_rows() fp32 rows (any leading shape) through the
    GEMV (more rows, up to GEMM_MAX_ROWS: kvstrata's fp32 GEMM over the same panels where
    `gemm`, the layer's gemm_above()), or None where neither applies (more rows, another dtype,
    no vector code: the caller runs oneDNN's layer). cap: the ISA cap (tests: 0 runs the
    scalar reference). fixed: every row count through the fp32 GEMM (deterministic
    inference: one reduction order whatever the rows, so a row's result does not depend on
    the batch; the GEMV sums in another order)."""
    # Called for each layer of a decode step (120 calls in SmolLM2's): cheap checks first.
    if x.dtype is not torch.float32 or not x.is_cpu:
        return None
    np_, k, _ = panels.shape
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, k)
    if not (fixed or _takes(x2.shape[0], gemm)) or x2.shape[1] != k:
        return None
    if x2.stride(1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], np_ * PANEL, dtype=torch.float32)
    call = gemv_call(x2, panels, bias, out, cap=cap, gemm=gemm, fixed=fixed)
    if call is None:
        return None
    call[0](*call[1])
    return out if flat else out.view(*x.shape[:-1], out.shape[1])


def _takes(m: int, gemm: bool) -> bool:
    """m rows run here: the GEMV's 1-max_rows(), or (gemm) the fp32 GEMM's to GEMM_MAX_ROWS."""
    return m <= max_rows() or (gemm and m <= GEMM_MAX_ROWS)


def gemv_call(x2: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
              out: torch.Tensor, threads: int | None = None, cap: int | None = None,
              gemm: bool = False, fixed: bool = False) -> tuple | None:
    """(C function, arguments) of the GEMV of fp32 rows x2 [m, k] (each row contiguous) into
    out [m, n] (contiguous), not run: `linear` makes this call, the decode plan
    (runner/models/decode_plan.py) keeps it; above max_rows() rows, where `gemm`, the fp32
    GEMM's (bf16_gemm.c linear_f32, the AVX2 tile; no scalar code) up to GEMM_MAX_ROWS. None
    where neither takes it (more rows, a bias it cannot add, no vector code unless `cap` is
    given). fixed: the fp32 GEMM for any number of rows (see `linear`)."""
    m, k = x2.shape
    n = panels.shape[0] * PANEL
    above = fixed or m > max_rows()
    if (not (fixed or _takes(m, gemm)) or x2.dtype is not torch.float32 or panels.shape[1] != k
            or (cap is None and not _vector_isa()) or (above and cap is not None and cap < 1)):
        return None
    if bias is not None and (bias.dtype is not torch.float32 or bias.numel() != n
                             or not bias.is_contiguous()):
        return None
    fn = _bf16_ops.linear_f32 if above else _cpu_ops.gemv_f32
    return fn, (x2.data_ptr(), x2.stride(0) if m > 1 else k, m, k, panels.data_ptr(), n,
                0 if bias is None else bias.data_ptr(), out.data_ptr(),
                torch.get_num_threads() if threads is None else threads,
                isa_cap() if cap is None else cap)
