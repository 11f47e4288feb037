"""The layer rule of ARCHITECTURE.md, checked on the source (AST), not by convention:
imports go down only, and engine/, cache/ and protocol/ never import torch."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "kvstrata"
BASE = {"protocol", "config", "platform", "envs", "version"}  # everyone may import these
ALLOWED = {
    "version": set(),
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


def _module_name(path: Path) -> str:
    parts = ("kvstrata",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the kvstrata modules it imports (anywhere in the file, a function-level
    import included: it is a dependency all the same). `from a import b` points at a.b when
    that is a module, else at a; a package's own __init__ reached only as the parent of a
    submodule is not an edge (Python runs it first, but it cannot import back here unless
    it says so itself, which is then an edge of its own)."""
    modules = {_module_name(p): p for p in SOURCES}
    # C extensions (setup.py) are leaves: `from pkg import _ext` imports _ext, not pkg.
    setup_py = (ROOT.parent / "setup.py").read_text()
    extensions = set(re.findall(r'[Ee]xtension\("([\w.]+)"', setup_py))
    assert extensions, "setup.py declares the C extensions"
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        tree = ast.parse(path.read_text(), str(path))
        # `if TYPE_CHECKING:` imports never run: an annotation naming the caller (a helper
        # module typed with the Scheduler that calls it) is no import order to get wrong
        typing_only = {id(n) for block in ast.walk(tree)
                       if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}"
                           if f"{node.module}.{a.name}" in modules.keys() | extensions
                           else node.module for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def test_no_import_circle_in_the_package():
    """An import circle makes the import order matter and hides a missing layer: none."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == [], f"import circles: {circles}"


# Sub-layers inside runner/ and engine/ (docs/architecture.md, "Layers"): a package's modules
# may import only the listed neighbours of their own parent package (module prefixes below
# kvstrata.runner / kvstrata.engine); the parent's root modules (model_runner.py, the engine
# core) may import any of them. So the grouping cannot decay: executors never import spec/,
# the kernels import no model code, sides never reach into the scheduler core, and TP reads
# the executors only through their registry.
SUB_LAYERS = {
    "runner": {
        "cpu": {"cpu"},
        "attention": {"attention", "cpu", "forward_batch"},
        "sampling": {"sampling", "cpu"},
        "quant": {"quant", "cpu", "forward_batch"},
        "executors": {"executors"},
        "recurrent": {"recurrent", "cpu", "forward_batch"},
        "models": {"models", "cpu", "attention", "quant", "forward_batch", "recurrent"},
        "parallel": {"parallel", "models", "cpu", "attention", "executors.registry"},
        "spec": {"spec", "models", "attention", "cpu", "sampling", "forward_batch",
                 "model_setup"},
    },
    "engine": {
        # the sides see requests, each other and the core's one shared constant; the
        # scheduler through its facade only (never kvstrata.engine.scheduler.core)
        "sides": {"sides", "request", "scheduler.facade", "scheduler.new_token_ratio"},
        "scheduler": {"scheduler", "request", "sides.base", "sides.registry"},
    },
}
# The one file that wires sides onto the Scheduler itself (annotations only).
SUB_LAYER_EXCEPTIONS = {"engine/sides/registry.py": {"scheduler.core"}}


def _sub_layer_cases():
    for layer, packages in SUB_LAYERS.items():
        for package in sorted(packages):
            for path in sorted((ROOT / layer / package).rglob("*.py")):
                yield layer, package, path


def test_every_sub_package_has_a_rule_and_a_file_map():
    for layer, packages in SUB_LAYERS.items():
        found = {p.name for p in (ROOT / layer).iterdir()
                 if p.is_dir() and (p / "__init__.py").exists()}
        assert found == set(packages), f"{layer}/ sub-packages without a rule: {found ^ set(packages)}"
        for package in packages:  # each says which file does what (the transfer/disagg way)
            text = (ROOT / layer / package / "__init__.py").read_text()
            for path in (ROOT / layer / package).glob("*.py"):
                if path.name != "__init__.py":
                    assert path.name in text, f"{layer}/{package}/__init__.py does not map {path.name}"


@pytest.mark.parametrize("layer,package,path", list(_sub_layer_cases()),
                         ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else "")
def test_sub_layer_imports(layer, package, path):
    allowed = SUB_LAYERS[layer][package] | SUB_LAYER_EXCEPTIONS.get(
        str(path.relative_to(ROOT)), set())
    prefix = f"kvstrata.{layer}."
    for module, line in imported_modules(ast.parse(path.read_text(), str(path))):
        if not module.startswith(prefix):
            continue
        rest = module[len(prefix):]
        assert any(rest == a or rest.startswith(a + ".") for a in allowed), (
            f"{path.relative_to(ROOT)}:{line} imports {module}: {layer}/{package}/ may only "
            f"import {sorted(allowed)} of {layer}/")
