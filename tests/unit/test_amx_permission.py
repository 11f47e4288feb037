"""The AMX GEMM bodies run only where Linux grants this process the tile data: the CPU's
AMX flags are not enough. A Firecracker guest (2026-12-07) advertised AMX, answered
ARCH_REQ_XCOMP_PERM with 0 and still left XTILEDATA out of the permitted set, so every bf16
GEMM above 4 rows died on ldtilecfg (SIGILL). runner/cpu/csrc/amx_tiles.h `amx_ready` reads
the permitted set; this checks its answer against the kernel's, and that a linear over the
AMX body's row counts runs. Skipped on a CPU without AMX."""
from __future__ import annotations

import ctypes
import platform

import pytest
import torch

SYS_ARCH_PRCTL = 158  # x86-64
# Linux's uapi asm/prctl.h (0x1024 is ARCH_GET_XCOMP_GUEST_PERM, a KVM guest's set: read in
# error here and in amx_tiles.h for a day, it turned the AMX bodies off everywhere)
ARCH_GET_XCOMP_SUPP, ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1021, 0x1022, 0x1023
XFEATURE_XTILEDATA = 18


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _tile_data_permitted() -> bool:
    """What Linux lets this process use, asked the way amx_tiles.h asks (request, then read
    the permitted set)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    perm = ctypes.c_ulong(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(perm)) != 0:
        return False
    return bool(perm.value >> XFEATURE_XTILEDATA & 1)


pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64"
    or not {"amx_tile", "amx_bf16", "amx_int8"} <= _cpu_flags(),
    reason="a CPU without AMX: the AMX bodies never run here")


def _xcomp(code: int) -> int | None:
    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.c_ulong(0)
    return value.value if libc.syscall(SYS_ARCH_PRCTL, code, ctypes.byref(value)) == 0 else None


def test_the_amx_bodies_run_where_the_kernel_supports_and_grants_the_tiles():
    """Checked against the supported set (another request than amx_ready's read): where the
    kernel supports XTILEDATA and grants the request, the permitted set holds it and both
    AMX bodies run -- the constant amx_ready reads cannot be another set's."""
    from kvstrata.runner.cpu import _bf16_ops, _int8_ops

    libc = ctypes.CDLL(None, use_errno=True)
    answered = libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    supported = _xcomp(ARCH_GET_XCOMP_SUPP)
    if answered != 0 or supported is None or not supported >> XFEATURE_XTILEDATA & 1:
        pytest.skip("this kernel does not support or grant the AMX tile data")
    assert _xcomp(ARCH_GET_XCOMP_PERM) >> XFEATURE_XTILEDATA & 1
    assert _bf16_ops.kernel_isa(3) == 3
    assert _int8_ops.kernel_isa(3) == 3


def test_the_amx_bodies_run_only_where_the_tiles_are_granted():
    from kvstrata.runner.cpu import _bf16_ops, _int8_ops

    granted = _tile_data_permitted()
    assert (_bf16_ops.kernel_isa(3) == 3) == granted
    assert (_int8_ops.kernel_isa(3) == 3) == granted


@pytest.mark.parametrize("rows", [5, 17, 64])
def test_a_bf16_linear_above_four_rows_runs_at_the_amx_cap(rows, monkeypatch):
    """Rows > 4 at KVSTRATA_CPU_ISA=amx: the AMX body where granted, else AVX512-BF16; either
    way one rounding from the exact product (the ungranted tiles killed the process)."""
    from kvstrata.runner.cpu.packed_linear import PackedLinear

    monkeypatch.setenv("KVSTRATA_CPU_ISA", "amx")
    torch.manual_seed(0)
    w = (torch.randn(960, 576) / 24).to(torch.bfloat16)
    layer = PackedLinear(w, None)
    if not layer.own:
        pytest.skip("kvstrata's bf16 GEMM does not take this weight here")
    x = torch.randn(rows, 576).to(torch.bfloat16)
    exact = x.double() @ w.double().T
    got = layer.own_rows(x).double()
    assert torch.allclose(got, exact, rtol=2 ** -7, atol=1e-3)
