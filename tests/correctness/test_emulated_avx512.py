"""The kernels' AVX-512 bodies (F, VNNI, BF16) and AMX bodies tested on CPUs without them.

The kernel tests pick each body by `KVSTRATA_CPU_ISA` and the CPU's flags, so on an AVX2-only
machine their AVX-512 cases ran the AVX2 bodies and an edit to shared code (an epilogue, a
panel layout) could break the AVX-512 ones unseen until an AVX-512 day. Here the same test
files run again in a child pytest on the kernels built with those instructions emulated
(tests/helpers/emulated_isa.py, runner/cpu/csrc/isa_emulation.h), once for each CPU generation
whose dispatch differs: AVX-512 with BF16 and VNNI (all of them), with AMX too (the AMX
bodies' items on tiles in memory), with VNNI but no BF16 and with neither (the files those
change). On CPUs with AVX-512 F / VNNI / BF16 the ordinary run covers those bodies and this
test skips.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import emulated_isa
from kvstrata.platform import read_cpu_flags

C = "tests/correctness/"
KERNEL_TEST_FILES = (
    C + "test_cpu_ops.py", C + "test_paged_decode_kernel.py", C + "test_bf16_gemm.py",
    C + "test_int8_linear.py", C + "test_f32_gemv.py", C + "test_decode_plan.py",
    C + "test_packed_linear.py", "tests/unit/test_shm_allreduce.py",
    C + "test_int8_gemm_amx.py", C + "test_prefill_attention_kernel.py",
    C + "test_gemm_side_rows.py", C + "test_batch_invariance.py",
    C + "test_paged_decode_softmax_extras.py", C + "test_deterministic_prefill.py")
# The files whose paths AMX changes (its bodies, bf16 prefill attention up to its token limit)
AMX_TEST_FILES = (
    C + "test_prefill_attention_kernel.py", C + "test_bf16_gemm.py", C + "test_int8_linear.py",
    C + "test_decode_plan.py", C + "test_packed_linear.py", C + "test_int8_gemm_amx.py",
    C + "test_batch_invariance.py")
# ... and those a CPU with AVX-512 F but without BF16 or VNNI changes (the bf16 GEMM's and
# the int8 GEMM's AVX2 bodies beside AVX-512 rows, attention (bf16 prefill widens to fp32),
# norms)
PARTIAL_AVX512_FILES = (
    C + "test_bf16_gemm.py", C + "test_packed_linear.py", C + "test_decode_plan.py",
    C + "test_int8_linear.py", C + "test_int8_gemm_amx.py", C + "test_paged_decode_kernel.py",
    C + "test_prefill_attention_kernel.py", C + "test_paged_decode_softmax_extras.py",
    C + "test_deterministic_prefill.py")
# Cases that run no emulated code: the all-reduce benchmark's ranks are spawned processes,
# which load the native build (the plugin installs the emulated one in this process only);
# its run took ~13 s of each emulated CPU's run for nothing (the ordinary run has it).
NATIVE_ONLY = ("tests/unit/test_shm_allreduce.py::"
               "test_allreduce_benchmark_reports_both_paths_against_memcpy",)
# The AMX bodies' items on tiles emulated in memory: with AVX512-BF16 and VNNI they run the
# same epilogues on the AVX512-BF16 CPU (a soak) as on the AMX one (a superset of its flags),
# whose run has their files: run there only (~30 s of emulated code saved).
AMX_TILES_IN_MEMORY = (C + "test_bf16_gemm.py::test_amx_body_emulated_is_one_rounding_from_exact",
                       C + "test_bf16_gemm.py::test_amx_body_emulated_silu_equals_the_two_steps",
                       C + "test_int8_gemm_amx.py::"
                           "test_amx_int8_tiles_emulated_equal_the_scalar_tile")
DESELECT = {"avx512_bf16": NATIVE_ONLY + AMX_TILES_IN_MEMORY}
# emulated CPU -> (the files it runs, what it multiplies with: has_bf16_512, the bf16 and the
# int8 GEMM's bodies: 3 AMX, 2 AVX-512, 1 AVX2)
RUNS = {
    "sapphirerapids": (KERNEL_TEST_FILES, ["True", "3", "3"]),
    "avx512_bf16": (AMX_TEST_FILES, ["True", "2", "2"]),
    "cascadelake": (PARTIAL_AVX512_FILES, ["False", "1", "2"]),
    "skylake": (PARTIAL_AVX512_FILES, ["False", "1", "1"]),
}
# `make test` runs one of them (its 10 minutes on 2 cores): the AMX CPU, whose flags hold
# every AVX-512 one (F, VNNI, BF16), over every kernel file -- the files AMX does not change
# dispatch there exactly as on an AVX512-BF16 CPU, and the tests that pick bodies by cap run
# the AVX-512 ones too. KVSTRATA_EMULATED_ALL=1 or KVSTRATA_SOAK=1 (a soak) adds the
# AVX512-BF16 CPU without AMX (the files AMX changes, dispatched to the AVX-512 GEMM bodies:
# Zen 4), Cascade Lake (AVX-512 and VNNI without BF16: bf16 widened to fp32 beside AVX-512
# rows) and Skylake (which differs from it only in the int8 GEMM's AVX2 body, tested natively
# on these AVX2 CPUs), and with KVSTRATA_EMULATED_ALL serves SmolLM2 on the AVX512-BF16 CPU as
# well as on the AMX one.
ALL = os.environ.get("KVSTRATA_EMULATED_ALL") == "1"
CPUS = list(RUNS) if ALL or os.environ.get("KVSTRATA_SOAK") == "1" else ["sapphirerapids"]

pytestmark = [
    pytest.mark.skipif(emulated_isa.native_avx512(),
                       reason="the CPU runs the AVX-512 bodies itself: the other tests cover them"),
    pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= read_cpu_flags(),
                       reason="the emulated build is AVX2 code"),
    pytest.mark.skipif(emulated_isa.simde_include() is None, reason="needs simde-py (make setup)"),
]


def _env(cpu: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not a worker
    env["KVSTRATA_EMULATED_ISA_DIR"] = str(emulated_isa.build())
    env["KVSTRATA_EMULATED_CPU_FLAGS"] = emulated_isa.CPUS[cpu]
    return env


@pytest.mark.parametrize("cpu", CPUS)
def test_kernel_tests_pass_on_the_emulated_cpu(cpu, tiny_checkpoints, tmp_path):
    """The emulated extensions load and choose that CPU's bodies (so the run tests those, not
    the AVX2 ones again: the child run's plugin reports its dispatch), and the kernel test
    files pass there. The child uses this run's tiny checkpoints (the same files)."""
    if cpu == "avx512_bf16":  # its deselected tile items run on the AMX CPU (see DESELECT)
        assert set(emulated_isa.CPUS[cpu].split()) <= set(emulated_isa.CPUS["sapphirerapids"]
                                                            .split())
        assert {case.split("::")[0] for case in AMX_TILES_IN_MEMORY} <= set(AMX_TEST_FILES)
    facts = tmp_path / "dispatch"
    env = {**_env(cpu), "KVSTRATA_EMULATED_DISPATCH_FILE": str(facts),
           "KVSTRATA_TEST_TINY_CHECKPOINTS": os.path.dirname(tiny_checkpoints["llama"])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.helpers.emulated_isa",
           "-p", "no:cacheprovider", "-p", "no:xdist", *RUNS[cpu][0],
           *(f"--deselect={case}" for case in DESELECT.get(cpu, NATIVE_ONLY))]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=emulated_isa.ROOT,
                          env=env, timeout=400)
    tail = done.stdout[-6000:] + done.stderr[-2000:]
    assert facts.exists(), tail
    assert facts.read_text().split() == RUNS[cpu][1] + ["True"]
    assert done.returncode == 0, tail
    assert " passed" in tail and "error" not in tail.splitlines()[-1], tail


# A soak (KVSTRATA_SOAK=1; with KVSTRATA_EMULATED_ALL=1 too, on both CPUs): the bodies it serves with are the
# kernel runs above; this checks the wiring (a server's processes load the emulated build,
# --dtype auto and /server_info follow the emulated flags).
@pytest.mark.soak
@pytest.mark.parametrize("cpu", ["avx512_bf16", "sapphirerapids"] if ALL else ["sapphirerapids"])
def test_served_smollm2_on_the_emulated_cpu(cpu):
    """A whole server on the emulated bodies: its processes load the build through the
    sitecustomize in its folder (PYTHONPATH), `--dtype auto` reads the emulated flags (bf16),
    /server_info names the AVX512-BF16 / AMX GEMM, and SmolLM2 still answers Paris."""
    import httpx

    from tests.e2e.server_utils import REPO, ServerProcess, ask_capital_of_france

    env = _env(cpu)
    build = env["KVSTRATA_EMULATED_ISA_DIR"]
    srv = ServerProcess("smollm2-135m", "--max-total-tokens", "4096", timeout=300, env={
        "PYTHONPATH": os.pathsep.join([build, REPO]), "KVSTRATA_EMULATED_ISA_DIR": build,
        "KVSTRATA_EMULATED_CPU_FLAGS": env["KVSTRATA_EMULATED_CPU_FLAGS"],
        "KVSTRATA_CPU_AUTO_DTYPE": ""})
    try:
        info = httpx.get(srv.base_url + "/server_info", timeout=30).json()
        assert info["dtype"] == "bfloat16"
        body = "AMX" if cpu == "sapphirerapids" else "AVX512-BF16"
        assert f"kvstrata bf16 GEMM ({body}" in info["quantization_info"]["kernel"], info
        answer = ask_capital_of_france(srv, max_tokens=12)
        assert "Paris" in answer, answer
    finally:
        srv.stop()
