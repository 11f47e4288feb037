"""The kernels' AVX-512 bodies (F, VNNI, BF16) tested on CPUs without AVX-512.

The kernel tests pick each body by `KVSTRATA_CPU_ISA` and the CPU's flags, so on an AVX2-only
machine their AVX-512 cases ran the AVX2 bodies and an edit to shared code (an epilogue, a
panel layout) could break the AVX-512 ones unseen until an AVX-512 day. Here the same test
files run again in a child pytest on the kernels built with those instructions emulated
(tests/helpers/emulated_isa.py, runner/csrc/isa_emulation.h), and once more with AMX
emulated as well (an AMX Xeon's dispatch, the AMX bodies' items on tiles in memory). On CPUs
with AVX-512 F / VNNI / BF16 the ordinary run covers those bodies and this test skips.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import emulated_isa
from kvstrata.platform import read_cpu_flags

KERNEL_TEST_FILES = (
    "tests/correctness/test_cpu_ops.py", "tests/correctness/test_paged_decode_kernel.py",
    "tests/correctness/test_bf16_gemm.py", "tests/correctness/test_int8_linear.py",
    "tests/correctness/test_f32_gemv.py", "tests/correctness/test_decode_plan.py",
    "tests/correctness/test_packed_linear.py", "tests/unit/test_shm_allreduce.py",
    "tests/correctness/test_int8_gemm_amx.py", "tests/correctness/test_prefill_attention_kernel.py")
# With AMX emulated too (an AMX Xeon's dispatch: the AMX bodies, bf16 prefill attention up to
# its token limit), the files whose paths AMX changes.
AMX_TEST_FILES = (
    "tests/correctness/test_prefill_attention_kernel.py", "tests/correctness/test_bf16_gemm.py",
    "tests/correctness/test_int8_linear.py", "tests/correctness/test_decode_plan.py",
    "tests/correctness/test_packed_linear.py", "tests/correctness/test_int8_gemm_amx.py")

pytestmark = [
    pytest.mark.skipif(emulated_isa.native_avx512(),
                       reason="the CPU runs the AVX-512 bodies itself: the other tests cover them"),
    pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= read_cpu_flags(),
                       reason="the emulated build is AVX2 code"),
    pytest.mark.skipif(emulated_isa.simde_include() is None, reason="needs simde-py (make setup)"),
]


@pytest.mark.parametrize("amx", [False, True])
def test_emulated_isa_build_reports_the_avx512_bodies(amx):
    """The emulated extensions load and choose their AVX-512 bodies (so the run below tests
    those, not the AVX2 ones again), or with amx their AMX bodies, on tiles in memory."""
    build_dir = emulated_isa.build(amx=amx)
    code = ("import sys; sys.path.insert(0, 'tests'); from helpers import emulated_isa; "
            f"emulated_isa.install({str(build_dir)!r}); "
            "from kvstrata.runner import _bf16_ops, _int8_ops; "
            "from kvstrata.runner.attention import paged_decode; "
            "print(_bf16_ops.has_bf16_512(2), _bf16_ops.kernel_isa(3), _int8_ops.kernel_isa(3), "
            "paged_decode._paged_decode.__file__.startswith(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", code, str(build_dir)], capture_output=True,
                          text=True, cwd=emulated_isa.ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    body = "3" if amx else "2"
    assert done.stdout.split() == ["True", body, body, "True"]


@pytest.mark.parametrize("amx", [False, True])
def test_kernel_tests_pass_on_emulated_avx512(amx):
    build_dir = emulated_isa.build(amx=amx)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not a worker
    env["KVSTRATA_EMULATED_ISA_DIR"] = str(build_dir)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.helpers.emulated_isa",
           "-p", "no:cacheprovider", "-p", "no:xdist",
           *(AMX_TEST_FILES if amx else KERNEL_TEST_FILES)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=emulated_isa.ROOT, env=env,
                          timeout=400)
    tail = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and "error" not in tail.splitlines()[-1], tail
