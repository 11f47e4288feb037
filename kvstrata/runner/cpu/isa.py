"""Which instruction set the CPU kernels may use: KVSTRATA_CPU_ISA's cap, read per call or
pinned for the length of one forward, and the kernels' own test for AVX2 + FMA + F16C.

Every kernel module (attention, GEMMs, row ops, the shared-memory all-reduce) asks this one
module, so there is one reading of the knob and one place that pins it. The C code picks its
body at run time from the CPU's flags (__builtin_cpu_supports) under this cap; nothing is
compiled for one fixed ISA.
"""
from __future__ import annotations

import contextlib
import functools

from kvstrata import envs
from kvstrata.runner.cpu import _cpu_ops

# amx: kvstrata's bf16 GEMM on AMX-BF16 tiles (runner/cpu/csrc/bf16_gemm_amx.h); the other
# kernels read it as avx512
ISA_CAPS = {"scalar": 0, "avx2": 1, "avx512": 2, "amx": 3, "auto": 3}

# KVSTRATA_CPU_ISA as read once for the forward under way (`pinned`); None outside one:
# then every call reads it (tests switch it per call).
_pinned_cap: int | None = None


def isa_cap() -> int:
    if _pinned_cap is not None:
        return _pinned_cap
    name = envs.KVSTRATA_CPU_ISA.get().strip().lower()
    if name not in ISA_CAPS:
        raise ValueError(f"KVSTRATA_CPU_ISA={name!r} is not one of {sorted(ISA_CAPS)}")
    return ISA_CAPS[name]


@contextlib.contextmanager
def pinned():
    """Read KVSTRATA_CPU_ISA once for a forward (~90 kernel calls would each read the
    environment); a nested forward keeps the outer reading."""
    global _pinned_cap
    saved = _pinned_cap
    _pinned_cap = isa_cap()
    try:
        yield _pinned_cap
    finally:
        _pinned_cap = saved


@functools.lru_cache(maxsize=1)
def cpu_has_avx2() -> bool:
    """The kernels' own CPU test (AVX2 + FMA + F16C, as the C code reads it at run time,
    emulated CPUs included)."""
    return bool(_cpu_ops.has_avx2())


__all__ = ["ISA_CAPS", "cpu_has_avx2", "isa_cap", "pinned"]
