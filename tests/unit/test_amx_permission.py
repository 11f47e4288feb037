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
ARCH_REQ_XCOMP_PERM, ARCH_GET_XCOMP_PERM = 0x1023, 0x1024
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
