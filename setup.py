# Metadata lives in pyproject.toml; this file only declares the C extensions: the CPU row copy
# behind HiCache's `kernel` IO backend (kvstrata/kv/rowcopy.py), the paged decode and prefill
# attention of the CPU attention backend (kvstrata/runner/attention/paged_decode.py), and the
# CPU row ops and GEMMs of kvstrata/runner/cpu/csrc/ (the shared-memory all-reduce of
# kvstrata/runner/parallel/csrc/ is compiled into `_cpu_ops`; GGUF's packed blocks' GEMM is
# `_gguf_ops`), the recurrent layers' decode step and deterministic inference's position-free
# element-wise ops (kvstrata/runner/recurrent/csrc/).
import os
import re

from setuptools import Extension, setup

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def included_headers(source: str) -> list[str]:
    """Every header `source` includes with quotes, transitively (paths relative to this
    file): an edited header must rebuild the extensions that include it, and a hand-kept
    `depends=` list missed two of them (tests/unit/test_setup_depends.py checks this)."""
    seen: list[str] = []
    todo = [source]
    while todo:
        path = todo.pop()
        with open(path) as f:
            text = f.read()
        for name in _INCLUDE.findall(text):
            header = os.path.normpath(os.path.join(os.path.dirname(path), name))
            if header not in seen:
                seen.append(header)
                todo.append(header)
    return sorted(seen)


def extension(name: str, source: str, **kwargs) -> Extension:
    return Extension(name, [source], depends=included_headers(source), **kwargs)


# OpenMP: at run time libgomp.so.1 resolves to torch's copy (already loaded, same soname), so
# the kernels share its team. -ffp-contract=off: no implicit FMA, so rope's products and sums
# round as torch's do and the scalar and vector rows of the int8 GEMM agree.
OPENMP = {"extra_compile_args": ["-O3", "-fopenmp"], "extra_link_args": ["-fopenmp"]}
OPENMP_EXACT = {"extra_compile_args": ["-O3", "-fopenmp", "-ffp-contract=off"],
                "extra_link_args": ["-fopenmp"]}

EXTENSIONS = [
    extension("kvstrata.kv._rowcopy", "kvstrata/kv/csrc/rowcopy.c", extra_compile_args=["-O3"]),
    extension("kvstrata.runner.attention._paged_decode",
              "kvstrata/runner/attention/csrc/paged_decode.c", **OPENMP),
    extension("kvstrata.runner.cpu._cpu_ops", "kvstrata/runner/cpu/csrc/cpu_ops.c", **OPENMP_EXACT),
    extension("kvstrata.runner.cpu._int8_ops", "kvstrata/runner/cpu/csrc/int8_ops.c", **OPENMP_EXACT),
    extension("kvstrata.runner.cpu._bf16_ops", "kvstrata/runner/cpu/csrc/bf16_gemm.c", **OPENMP_EXACT),
    extension("kvstrata.runner.cpu._gguf_ops", "kvstrata/runner/cpu/csrc/gguf_ops.c", **OPENMP_EXACT),
    extension("kvstrata.runner.recurrent._recurrent_step",
              "kvstrata/runner/recurrent/csrc/recurrent_step.c", **OPENMP),
    # every element through the same scalar libm code (deterministic inference)
    extension("kvstrata.runner.recurrent._pointwise", "kvstrata/runner/recurrent/csrc/pointwise.c",
              extra_compile_args=[*OPENMP_EXACT["extra_compile_args"], "-fno-tree-vectorize"],
              extra_link_args=OPENMP_EXACT["extra_link_args"]),
]

if __name__ == "__main__":
    setup(ext_modules=EXTENSIONS,
          # the extensions compile side by side (~13 -> ~7 s of a fresh set-up on 2 cores)
          options={"build_ext": {"parallel": os.cpu_count() or 1}})
