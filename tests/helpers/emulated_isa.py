"""kvstrata's CPU kernels built with the instruction sets beyond AVX2 emulated (AVX-512 F, BW,
DQ, VL, VNNI, BF16; AMX-BF16 / AMX-INT8), for the tests on machines without them.

Our machines alternate between AVX2-only and AVX-512 BF16 CPUs, and the kernels pick their
body at run time, so an AVX2 day's suite never ran the AVX-512 or AMX bodies (an edit to a
shared epilogue could break them unseen). `build()` compiles the four kernel extensions again
with KVSTRATA_EMULATE_AVX512 defined (runner/cpu/csrc/isa_emulation.h: SIMDe's portable AVX-512 on
top of AVX2, `__builtin_cpu_supports` answering for the CPU that KVSTRATA_EMULATED_CPU_FLAGS
names, one of CPUS below; AMX's tiles in memory), and `install()` puts them in `sys.modules`
before kvstrata imports its own, and makes kvstrata.platform's /proc/cpuinfo flags name the
same sets; the kernel tests then run unchanged on that CPU's bodies and dispatch. As a pytest
plugin (`-p tests.helpers.emulated_isa` with KVSTRATA_EMULATED_ISA_DIR set to a build) it
installs them before any test module is imported.

Any test file can run so, e.g. the bf16 quality guard on the AVX512-BF16 bodies (~2 min; with
KVSTRATA_EMULATED_CPU_FLAGS set to CPUS["sapphirerapids"] below, on AMX's, ~4 min):
    KVSTRATA_EMULATED_ISA_DIR=$(.venv/bin/python tests/helpers/emulated_isa.py) \
        .venv/bin/python -m pytest -p tests.helpers.emulated_isa \
        tests/correctness/test_bf16_quality.py
Tests that start servers need the build in those processes too: with the build's folder on
PYTHONPATH its sitecustomize.py installs it in every Python process started (a server's
scheduler and detokenizer too), e.g. a served bf16 run on AMX's bodies:
    D=$(.venv/bin/python tests/helpers/emulated_isa.py); KVSTRATA_EMULATED_ISA_DIR=$D \
        PYTHONPATH=$D KVSTRATA_EMULATED_CPU_FLAGS="avx512f avx512bw avx512dq avx512vl \
        avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8" KVSTRATA_CPU_AUTO_DTYPE=bfloat16 \
        .venv/bin/python -m pytest -p tests.helpers.emulated_isa tests/e2e/test_openai_api.py
Only kvstrata's own code is emulated: what torch's libraries run (oneDNN's and fbgemm's int8
linears) is the real CPU's code, so a flow that an emulated VNNI flag routes through them (a
w8a8 layer of a shape kvstrata's int8 GEMM does not take: AVX2's u8 x s8 pairs saturate) does
not hold there (test_int8_linear.py's oneDNN comparisons skip, and so do test_w8a8_int8.py's
8-bit fbgemm case and its tiny model's greedy tokens, intermediate size 88).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# module -> its one C file; each file includes its headers from kvstrata/*/csrc/
EXTENSIONS = {
    "kvstrata.runner.cpu._cpu_ops": "kvstrata/runner/cpu/csrc/cpu_ops.c",
    "kvstrata.runner.cpu._int8_ops": "kvstrata/runner/cpu/csrc/int8_ops.c",
    "kvstrata.runner.cpu._bf16_ops": "kvstrata/runner/cpu/csrc/bf16_gemm.c",
    "kvstrata.runner.attention._paged_decode": "kvstrata/runner/attention/csrc/paged_decode.c",
}
# The extensions' own flags (setup.py) but -O1 (each file compiles in 1-4 s, not 10-40 s at
# -O3) and AVX2 for the whole file: SIMDe then runs each 512-bit op as two 256-bit ones.
FLAGS = ["-shared", "-fPIC", "-O1", "-fopenmp", "-ffp-contract=off", "-mavx2", "-mfma",
         "-mf16c", "-Wno-psabi", "-DKVSTRATA_EMULATE_AVX512"]
CACHE = Path(tempfile.gettempdir()) / "kvstrata-emulated-isa"  # builds by sources' digest
# The emulated CPU: its /proc/cpuinfo flags beyond AVX2, in KVSTRATA_EMULATED_CPU_FLAGS (read
# by the C side, isa_emulation.h, and by install() for Python's); unset, install() sets it
# to DEFAULT_CPU's.
CPUS = {
    "skylake": "avx512f avx512bw avx512dq avx512vl",  # AVX-512 without VNNI or BF16
    "cascadelake": "avx512f avx512bw avx512dq avx512vl avx512_vnni",  # VNNI, no BF16
    "avx512_bf16": "avx512f avx512bw avx512dq avx512vl avx512_vnni avx512_bf16",  # Zen 4
    "sapphirerapids": "avx512f avx512bw avx512dq avx512vl avx512_vnni avx512_bf16 amx_tile "
                      "amx_bf16 amx_int8",  # AMX: the bodies' items on tiles in memory
}
DEFAULT_CPU = "avx512_bf16"
EMULATED_FLAGS = frozenset(CPUS[DEFAULT_CPU].split())  # what the real CPU must have to skip


# Written into each build's folder: with that folder on PYTHONPATH every Python process
# started from the run (a test's server, its spawned scheduler and detokenizer) installs
# the build at start-up, as the pytest plugin does in the test process (it shadows the
# system's sitecustomize, Debian's apport hook, in those processes only).
SITECUSTOMIZE = '''"""Written by tests/helpers/emulated_isa.py (see there)."""
import importlib.util
import os

_here = os.path.dirname(os.path.abspath(__file__))
_wanted = os.environ.get("KVSTRATA_EMULATED_ISA_DIR")
if _wanted and os.path.realpath(_wanted) == os.path.realpath(_here):
    _spec = importlib.util.spec_from_file_location("kvstrata_emulated_isa", {helper!r})
    _helper = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_helper)
    _helper.install(_here)
'''


def simde_include() -> str | None:
    """SIMDe's headers (the dev dependency simde-py), or None when it is not installed."""
    try:
        import simde_py
    except ImportError:
        return None
    return simde_py.get_include()


def _sources_digest() -> str:
    # the sitecustomize names this checkout's helper: another checkout builds its own
    digest = hashlib.sha256(" ".join(FLAGS).encode() + SITECUSTOMIZE.encode()
                            + str(Path(__file__).resolve()).encode())
    for path in sorted(ROOT.glob("kvstrata/**/csrc/*.[ch]")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def build(cache: Path = CACHE) -> Path:
    """The four emulated extensions under cache/<digest of the sources>/ (built once per
    version of the sources: a finished build is marked by its `done` file)."""
    include = simde_include()
    if include is None:
        raise RuntimeError("simde-py is not installed (a dev dependency: make setup)")
    out = cache / _sources_digest()
    if (out / "done").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    python_include = sysconfig.get_paths()["include"]

    def compile_one(item: tuple[str, str]) -> None:
        name, source = item
        target = out / (name.rsplit(".", 1)[1] + suffix)
        partial = target.with_name(f"{target.name}.{os.getpid()}")  # concurrent suites
        cmd = ["cc", *FLAGS, f"-I{python_include}", f"-I{include}", str(ROOT / source),
               "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        os.replace(partial, target)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, EXTENSIONS.items()))
    (out / "sitecustomize.py").write_text(SITECUSTOMIZE.format(helper=str(Path(__file__))))
    (out / "done").write_text("ok\n")
    return out


def install(build_dir: Path) -> None:
    """Load the emulated extensions as kvstrata's own (before anything imports those), as
    the CPU KVSTRATA_EMULATED_CPU_FLAGS names (set here to DEFAULT_CPU's when unset: the C
    side reads it too)."""
    build_dir = Path(build_dir)
    emulated = frozenset(os.environ.setdefault("KVSTRATA_EMULATED_CPU_FLAGS",
                                               CPUS[DEFAULT_CPU]).split())
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if _installed(build_dir):
        return  # this process's sitecustomize did (PYTHONPATH=<the build>)
    for name in EXTENSIONS:
        if name in sys.modules:
            raise RuntimeError(f"{name} was imported before the emulated build was installed")
        path = build_dir / (name.rsplit(".", 1)[1] + suffix)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    for name, module in [(n, sys.modules[n]) for n in EXTENSIONS]:
        parent, _, child = name.rpartition(".")
        setattr(importlib.import_module(parent), child, module)
    # Python's side of the dispatch (and the tests' expectations) read /proc/cpuinfo: it
    # names the emulated sets too, before any module binds read_cpu_flags by name.
    from kvstrata import platform

    real = platform.read_cpu_flags

    def read_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset:
        flags = real(path)
        return flags | emulated if path == "/proc/cpuinfo" else flags

    platform.read_cpu_flags = read_cpu_flags


def _installed(build_dir: Path) -> bool:
    """Every emulated extension of `build_dir` is the loaded one."""
    for name in EXTENSIONS:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path is None or Path(path).resolve().parent != build_dir.resolve():
            return False
    return True


def native_avx512() -> bool:
    """The CPU runs the AVX-512 bodies itself (their tests need no emulation there)."""
    from kvstrata.platform import read_cpu_flags

    return EMULATED_FLAGS <= read_cpu_flags()


def dispatch_facts(build_dir: Path) -> list[str]:
    """What the installed build picks on the emulated CPU: has_bf16_512(2), the bf16 and int8
    GEMMs' bodies for cap 3 (3 AMX, 2 AVX-512, 1 AVX2), and whether the paged decode module
    is the build's."""
    from kvstrata.runner.attention import paged_decode
    from kvstrata.runner.cpu import _bf16_ops, _int8_ops

    module = Path(paged_decode._paged_decode.__file__).resolve()
    return [str(_bf16_ops.has_bf16_512(2)), str(_bf16_ops.kernel_isa(3)),
            str(_int8_ops.kernel_isa(3)), str(module.parent == Path(build_dir).resolve())]


def pytest_configure(config) -> None:  # the plugin's entry (-p tests.helpers.emulated_isa)
    build_dir = os.environ.get("KVSTRATA_EMULATED_ISA_DIR")
    if build_dir:
        install(Path(build_dir))
        report = os.environ.get("KVSTRATA_EMULATED_DISPATCH_FILE")
        if report:  # test_emulated_avx512.py checks the run tested that CPU's bodies
            Path(report).write_text(" ".join(dispatch_facts(Path(build_dir))))


BELOW_AVX512 = frozenset({"scalar", "avx2"})


def pytest_collection_modifyitems(config, items) -> None:
    """Cases whose `isa` parameter caps the kernels below AVX-512 run no emulated code (the
    AVX2 bodies are the native ones at -O1): the ordinary run has them (306 of 756 cases of
    the kernel files)."""
    if not os.environ.get("KVSTRATA_EMULATED_ISA_DIR"):
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        (drop if params.get("isa") in BELOW_AVX512 else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


if __name__ == "__main__":  # a build's folder: KVSTRATA_EMULATED_ISA_DIR=$(python ...)
    print(build())
