"""Speculation's worker half has one interface (runner/spec/worker.py SpecWorker): the model
runner touches nothing of its draft outside it, and every draft class implements all of it,
so the runner never asks which draft it holds (no hasattr / getattr probing)."""
from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

from kvstrata.runner import model_runner
from kvstrata.runner.spec.eagle import EagleDraft
from kvstrata.runner.spec.mtp import MTPDraft
from kvstrata.runner.spec.standalone import DraftModel
from kvstrata.runner.spec.worker import SpecWorker

ANNOTATED = set(SpecWorker.__annotations__)
CALLABLE = {n for n, v in vars(SpecWorker).items()
            if not n.startswith("_") and (callable(v) or isinstance(v, property))}


def _draft_uses(tree: ast.AST):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "draft" and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"):
            yield node


def test_the_runner_uses_only_the_interface():
    path = Path(model_runner.__file__)
    tree = ast.parse(path.read_text())
    for node in _draft_uses(tree):
        assert node.attr in ANNOTATED | CALLABLE, (
            f"model_runner.py:{node.lineno} uses draft.{node.attr}, not in SpecWorker")
    for node in ast.walk(tree):  # no probing of which draft it is
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr", "isinstance")
                and any("draft" in ast.unparse(a) for a in node.args[:1])):
            raise AssertionError(f"model_runner.py:{node.lineno} asks what the draft is: "
                                 f"{ast.unparse(node)}")


def _assigned_in_init(cls) -> set[str]:
    names = set()
    for klass in cls.__mro__[:-1]:  # not object
        for fn in ("__init__", "_init_state"):
            if fn in vars(klass):
                tree = ast.parse(textwrap.dedent(inspect.getsource(vars(klass)[fn])))
                for node in ast.walk(tree):
                    targets = (node.targets if isinstance(node, ast.Assign)
                               else [node.target] if isinstance(node, ast.AnnAssign) else [])
                    for t in targets:
                        for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                            if isinstance(el, ast.Attribute):
                                names.add(el.attr)
    return names


def test_every_draft_implements_the_interface():
    for cls in (DraftModel, EagleDraft, MTPDraft):
        for name in CALLABLE:
            assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        missing = ANNOTATED - _assigned_in_init(cls)
        assert not missing, f"{cls.__name__} never sets {missing}"
