"""A pytest plugin that records the CPU seconds each test file costs (this process and the
children it waited for, e.g. the servers a file starts and stops), to re-rank
tests/conftest.py's LONG_FILES_FIRST and to find what pushes `make test` past its budget:

    KVSTRATA_FILE_CPU_DIR=/tmp/cpu .venv/bin/python -m pytest -p tests.helpers.file_cpu \
        -q -n 2 --dist loadfile --no-loadscope-reorder tests
    .venv/bin/python tests/helpers/file_cpu.py /tmp/cpu     # the files, costliest first

On 2 cores the suite is CPU-bound, so a file's CPU stands for its share of the wall time.
"""
from __future__ import annotations

import json
import os
import resource
import sys

_current: list = [None, 0.0]  # the file being run, the CPU reading when it started
_spent: dict[str, float] = {}


def _cpu() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _close_current() -> None:
    if _current[0] is not None:
        _spent[_current[0]] = _spent.get(_current[0], 0.0) + _cpu() - _current[1]


def pytest_runtest_logstart(nodeid, location):
    path = nodeid.split("::")[0]
    if path != _current[0]:
        _close_current()
        _current[0], _current[1] = path, _cpu()


def pytest_sessionfinish(session):
    _close_current()
    folder = os.environ.get("KVSTRATA_FILE_CPU_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"cpu-{os.getpid()}.json"), "w") as out:
            json.dump(_spent, out)


if __name__ == "__main__":
    merged: dict[str, float] = {}
    for name in os.listdir(sys.argv[1]):
        with open(os.path.join(sys.argv[1], name)) as f:
            for path, seconds in json.load(f).items():
                merged[path] = merged.get(path, 0.0) + seconds
    print(f"{sum(merged.values()):.0f} CPU-s in {len(merged)} files")
    for path, seconds in sorted(merged.items(), key=lambda kv: -kv[1]):
        print(f"{seconds:8.1f}  {path}")
