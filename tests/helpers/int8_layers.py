"""What the int8 layer's test files share (test_int8_linear.py, test_int8_gemm_amx.py)."""
from __future__ import annotations

import pytest

from kvstrata.runner.cpu import int8_linear
from kvstrata.runner.cpu.int8_linear import Int8MatmulLinear


def layer(weight, bias, gemm, monkeypatch) -> Int8MatmulLinear:
    """A layer packed under KVSTRATA_CPU_INT8_GEMM=gemm (read when the weight is packed)."""
    monkeypatch.setenv("KVSTRATA_CPU_INT8_GEMM", gemm)
    return Int8MatmulLinear(weight, bias)


def int8_isa_now(cap: int) -> int:
    """What the int8 GEMM multiplies with under this ISA cap (3: AMX-INT8 where present)."""
    from kvstrata.runner.cpu import _int8_ops
    return _int8_ops.kernel_isa(cap)


own_gemm = pytest.mark.skipif(not int8_linear.own_gemm_fits(64, 64),
                              reason="kvstrata's int8 GEMM needs AVX512-VNNI or AVX2")
