"""The layer rule of ARCHITECTURE.md, checked on the source (AST), not by convention:
imports go down only, and engine/, cache/ and protocol/ never import torch."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "kvstrata"
BASE = {"protocol", "config", "platform", "envs"}  # everyone may import these
ALLOWED = {
    "protocol": {"protocol"},
    "config": BASE,
    "platform": BASE,
    "envs": BASE,
    "cache": BASE | {"cache"},
    "kv": BASE | {"kv"},
    "transfer": BASE | {"transfer", "kv"},
    "runner": BASE | {"runner", "kv", "transfer"},
    "engine": BASE | {"engine", "cache"},
    "metrics": BASE | {"metrics"},
    "frontend": BASE | {"frontend", "engine", "cache", "metrics"},
    "bench": None,  # clients and benchmarks sit beside entrypoints, at the top
    "entrypoints": None,  # the top: may import anything
}
TORCH_FREE = {"protocol", "config", "engine", "cache", "platform", "envs"}
# platform.py detects the hardware from torch, lazily inside functions; that is its job.
TORCH_ALLOWED_FILES = {ROOT / "platform.py"}


def layer_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def imported_modules(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
    return found


SOURCES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_layer_imports(path):
    layer = layer_of(path)
    if layer == "__init__":
        return
    assert layer in ALLOWED, f"{layer}/ is not in ARCHITECTURE.md's layer list (add it there and here)"
    tree = ast.parse(path.read_text(), str(path))
    for module, line in imported_modules(tree):
        top = module.split(".")[0]
        if top == "torch" and layer in TORCH_FREE and path not in TORCH_ALLOWED_FILES:
            pytest.fail(f"{path.relative_to(ROOT)}:{line} imports torch; {layer}/ must stay torch-free")
        if top != "kvstrata" or ALLOWED[layer] is None:
            continue
        parts = module.split(".")
        target = parts[1] if len(parts) > 1 else "__init__"
        if target == "__init__":
            continue
        assert target in ALLOWED[layer], (
            f"{path.relative_to(ROOT)}:{line} imports kvstrata.{target}: {layer}/ may only import "
            f"{sorted(ALLOWED[layer])}")


def test_engine_and_cache_load_without_torch():
    """Importing the scheduler must not pull torch in transitively either."""
    import subprocess
    import sys

    code = ("import sys; import kvstrata.engine.engine_core, kvstrata.cache.kv_manager; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
