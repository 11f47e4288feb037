"""Fused element-wise ops for the llama-family decoder on the CPU (the C extension
`_cpu_ops`, csrc/cpu_ops.c): RMSNorm in bf16 and fp32 (alone, or after the residual add),
silu(gate) * up, and the rotary embedding of q and k in place inside the fused qkv projection.

Why: after the linear layers were prepacked and decode attention read the pool in place, a
bf16 batched prefill (12 prompts x 160 tokens of SmolLM2) still spent ~20% in element-wise ops
that each read and write the whole activation: HF's bf16 RMSNorm is seven ops (upcast, square,
mean, rsqrt, scale, downcast, weight), the MLP's activation two (silu, then the product). One
pass each here. The arithmetic and roundings are HF's (fp32 inside, bf16 where torch's
unfused ops round), so results equal the op sequences up to fp32 summation order.

Later, in a bf16 decode step at batch 32 (SmolLM2), the rotary embedding was 3 torch ops a
layer (cat, mul, addcmul, each a new tensor), the residual add one more, and the paged
attention kernel's fp32 query and output two conversions: fusing them took the step 5-8%
faster in bf16, 2-5% in fp32 (A/B in one process, docs/benchmarks.md). The fused rotation is
bit-exact with transformers' (each product rounded, then the sum; the torch ops it replaces
rounded once, inside addcmul).

In fp32 (what --dtype auto serves on an AVX2-only CPU) torch's rms_norm cost ~50 us a call
inside a SmolLM2 decode step, most of it waking torch's thread team for a few KB: the fp32
norms (csrc/rms_f32_rows.h) stay on the caller's thread for small batches.

`rms_norm` / `silu_mul` / `add_rms_norm` return None (`rope_` False) when a tensor does not fit (not on the CPU, rows not
contiguous inside, other dtypes, KVSTRATA_CPU_FUSED_OPS=0): the caller keeps torch's ops.
"""
from __future__ import annotations

import functools
import math

import torch

from kvstrata import envs
from kvstrata.runner.cpu import _cpu_ops
from kvstrata.runner.cpu import isa
from kvstrata.runner.cpu.isa import isa_cap

DTYPES = {torch.float32: 0, torch.bfloat16: 1}


# KVSTRATA_CPU_FUSED_OPS as read once for the forward under way (`fixed_settings`).
_pinned_enabled: bool | None = None


def fixed_settings(forward):
    """Decorates a model's forward: KVSTRATA_CPU_FUSED_OPS and KVSTRATA_CPU_ISA are read
    once for it, not by each of its ~90 op calls (an environment read costs ~6 us through
    envs: ~1.3 ms of a SmolLM2 decode step, cProfile). Calls outside a forward read them
    each time (tests switch them per call)."""
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        global _pinned_enabled
        saved = _pinned_enabled  # a nested forward keeps it
        _pinned_enabled = enabled()
        try:
            with isa.pinned():
                return forward(*args, **kwargs)
        finally:
            _pinned_enabled = saved
    return wrapper


def _rows(x: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of a CPU tensor whose last dim is contiguous and whose leading dims
    flatten to evenly strided rows; None otherwise."""
    if x.device.type != "cpu" or x.dim() < 1 or x.stride(-1) != 1:
        return None
    if x.is_contiguous():
        return x.numel() // max(1, x.shape[-1]), x.shape[-1]
    if x.dim() == 1:
        return 1, x.shape[0]
    lead = x.shape[:-1]
    stride = x.stride(-2)
    expect = stride
    for size, st in zip(reversed(lead), reversed(x.stride()[:-1])):
        if size != 1 and st != expect:
            return None
        expect *= size
    return math.prod(lead), stride


def enabled() -> bool:
    if _pinned_enabled is not None:
        return _pinned_enabled
    return envs.KVSTRATA_CPU_FUSED_OPS.get()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """HF's RMSNorm (bf16: its two roundings; fp32) in one pass, or None (caller falls
    back)."""
    if x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype \
            or not enabled():
        return None
    rows = _rows(x)
    if rows is None and x.device.type == "cpu" and x.dim() > 1 and x.stride(-1) == 1:
        # Per-head q / k norms of several tokens read a view of the fused qkv projection
        # whose rows are not evenly strided; one token's are. Copied, both run this kernel:
        # torch's fallback rounds its sums otherwise, and a token's norm would depend on how
        # many tokens share its forward (deterministic inference caught that).
        x = x.contiguous()
        rows = _rows(x)
    h = x.shape[-1]
    if rows is None or weight.numel() != h or not weight.is_contiguous() \
            or weight.device.type != "cpu":
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    op = _cpu_ops.rms_norm_bf16 if x.dtype == torch.bfloat16 else _cpu_ops.rms_norm_f32
    op(x.data_ptr(), rows[1], rows[0], h, weight.data_ptr(), out.data_ptr(), float(eps),
       torch.get_num_threads(), isa_cap())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up = [..., gate | up], or None (caller falls back)."""
    if gate_up.dtype not in DTYPES or not enabled() or gate_up.shape[-1] % 2:
        return None
    rows = _rows(gate_up)
    if rows is None:
        return None
    n = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], n, dtype=gate_up.dtype)
    _cpu_ops.silu_mul(gate_up.data_ptr(), rows[1], rows[0], n, out.data_ptr(),
                      DTYPES[gate_up.dtype], torch.get_num_threads(), isa_cap())
    return out


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """The first index of each row's maximum of 2-D fp32 logits (a row with NaN: its first
    NaN), as torch.max(dim=-1).indices; or None (caller falls back)."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or not enabled():
        return None
    rows = _rows(logits)
    if rows is None or not logits.shape[1]:
        return None
    out = torch.empty(rows[0], dtype=torch.int64)
    _cpu_ops.argmax_rows(logits.data_ptr(), rows[1], rows[0], logits.shape[1], out.data_ptr(),
                         torch.get_num_threads(), isa_cap())
    return out.tolist()


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
    """x += y in place (bf16 or fp32), then HF's RMSNorm of the new x, in one pass; or None
    (nothing done: the caller adds and norms with its own ops)."""
    if (x.dtype not in (torch.bfloat16, torch.float32) or y.dtype != x.dtype
            or weight.dtype != x.dtype or not enabled() or x.device.type != "cpu"
            or y.device.type != "cpu" or weight.device.type != "cpu"
            or not x.is_contiguous() or not y.is_contiguous() or x.shape != y.shape
            or weight.numel() != x.shape[-1] or not weight.is_contiguous()):
        return None
    h = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype)
    op = _cpu_ops.add_rms_norm_bf16 if x.dtype == torch.bfloat16 else _cpu_ops.add_rms_norm_f32
    op(x.data_ptr(), y.data_ptr(), x.numel() // max(1, h), h, weight.data_ptr(),
       out.data_ptr(), float(eps), torch.get_num_threads(), isa_cap())
    return out


def rope_(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate the first `heads` head_dim-wide heads of each row of x [T, >= heads * D] in
    place (cos / signed sin [T, 1, D] as rope.py cos_sin returns them, x's dtype), with
    HF's roundings. False (nothing done) when the tensors do not fit: the caller rotates."""
    if x.dtype not in DTYPES or not enabled() or x.dim() != 2:
        return False
    d = cos.shape[-1]
    rows = _rows(x)
    if (rows is None or cos.dtype != x.dtype or sin.dtype != x.dtype or d % 2
            or x.shape[1] < heads * d or cos.numel() != x.shape[0] * d
            or sin.numel() != cos.numel() or not cos.is_contiguous()
            or not sin.is_contiguous()):
        return False
    _cpu_ops.rope(x.data_ptr(), rows[1], rows[0], heads, d, cos.data_ptr(), sin.data_ptr(),
                  DTYPES[x.dtype], torch.get_num_threads(), isa_cap())
    return True
