# Metadata lives in pyproject.toml; this file only declares the one C extension (the CPU
# row copy behind HiCache's `kernel` IO backend, see kvstrata/kv/rowcopy.py).
from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstrata.kv._rowcopy", ["kvstrata/kv/csrc/rowcopy.c"],
                             extra_compile_args=["-O3"])])
