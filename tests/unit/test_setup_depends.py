"""setup.py's depends= lists: every header an extension includes (transitively) is listed,
so an edited header rebuilds the extensions that use it (a hand-kept list missed two), and
every header in the tree belongs to some extension (none is dead)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _setup_module():
    spec = importlib.util.spec_from_file_location("kvstrata_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: declares the extensions, builds nothing
    return module


def test_every_included_header_is_a_dependency(monkeypatch):
    monkeypatch.chdir(REPO)
    setup = _setup_module()
    for ext in setup.EXTENSIONS:
        (source,) = ext.sources
        todo, seen = [Path(source)], set()
        while todo:  # an independent walk of the #include "..." graph
            path = todo.pop()
            for name in re.findall(r'#include "([^"]+)"', path.read_text()):
                header = (path.parent / name).resolve().relative_to(REPO)
                if header not in seen:
                    seen.add(header)
                    todo.append(REPO / header)
        assert {Path(d) for d in ext.depends} == seen, ext.name
        assert all((REPO / d).is_file() for d in ext.depends), ext.name


def test_every_header_belongs_to_an_extension(monkeypatch):
    monkeypatch.chdir(REPO)
    used = {Path(d) for ext in _setup_module().EXTENSIONS for d in ext.depends}
    headers = {p.relative_to(REPO) for p in (REPO / "kvstrata").rglob("csrc/*.h")}
    assert headers - used == set(), "headers no extension includes"
