"""The sides' facade is real (engine/scheduler/facade.py): every side is given the scheduler
typed as SchedulerFacade and touches nothing else of it, never mutates the core's queues and
never reaches into another object's private state; the core's helper modules take the
scheduler typed; and Scheduler implements the Protocol. Checked on the source (AST)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from kvstrata.engine.scheduler.core import Scheduler, SchedulerConfig
from kvstrata.engine.scheduler.facade import SchedulerFacade
from kvstrata.engine.scheduler.stop_checker import StopChecker

ENGINE = Path(__file__).resolve().parents[2] / "kvstrata" / "engine"
# registry.py wires sides onto the Scheduler itself (it appends to `sched.sides`)
SIDES = sorted(p for p in (ENGINE / "sides").glob("*.py")
               if p.name not in ("__init__.py", "registry.py"))
MUTATORS = {"append", "remove", "pop", "insert", "extend", "clear", "sort", "reverse"}


def facade_members() -> set[str]:
    names = set(getattr(SchedulerFacade, "__annotations__", {}))
    names |= {n for n, v in vars(SchedulerFacade).items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def _is_sched(node: ast.AST) -> bool:
    """`sched` or `self.sched`: how sides hold the facade."""
    return ((isinstance(node, ast.Name) and node.id == "sched")
            or (isinstance(node, ast.Attribute) and node.attr == "sched"
                and isinstance(node.value, ast.Name) and node.value.id == "self"))


@pytest.mark.parametrize("path", SIDES, ids=lambda p: p.name)
def test_a_side_uses_only_the_facade(path):
    members = facade_members()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_sched(node.value):
            assert node.attr in members, (
                f"{path.name}:{node.lineno} uses sched.{node.attr}, which is not in "
                f"SchedulerFacade (add it there, typed and documented, or do without)")
            continue
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Attribute)
                and _is_sched(node.func.value.value)):
            pytest.fail(f"{path.name}:{node.lineno} mutates sched.{node.func.value.attr}: "
                        f"hand requests over through the facade's methods")
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                assert not (isinstance(target, ast.Attribute) and _is_sched(target.value)), (
                    f"{path.name}:{node.lineno} assigns sched.{target.attr}")
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            pytest.fail(f"{path.name}:{node.lineno} reaches into another object's "
                        f"private .{node.attr}")


def _params(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args + node.args.kwonlyargs:
                if arg.arg in ("sched", "side", "facade"):
                    yield node, arg


@pytest.mark.parametrize("path", sorted(ENGINE.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ENGINE)))
def test_scheduler_and_side_parameters_are_typed(path):
    in_sides = path.parent.name == "sides" and path.name != "registry.py"
    for func, arg in _params(path):
        assert arg.annotation is not None, (
            f"{path.relative_to(ENGINE)}:{func.lineno} {func.name}({arg.arg}) is untyped")
        if arg.arg == "sched":
            want = "SchedulerFacade" if in_sides else "Scheduler"
            if path.name == "core.py":
                continue  # Scheduler.update's `sched` is the SchedulerOutput it applies
            assert ast.unparse(arg.annotation) == want, (
                f"{path.relative_to(ENGINE)}:{func.lineno} {func.name}(sched) is "
                f"{ast.unparse(arg.annotation)}, want {want}")


def test_the_scheduler_implements_the_facade():
    sched = Scheduler(SchedulerConfig(num_pages=16, page_size=1), StopChecker(eos_token_ids=[], max_context_len=64))
    assert isinstance(sched, SchedulerFacade)
    for name in facade_members():
        assert hasattr(sched, name), name
        protocol = getattr(SchedulerFacade, name, None)  # None: an annotated attribute
        if callable(protocol) and not isinstance(protocol, property):
            ours = inspect.signature(getattr(sched, name))
            theirs = inspect.signature(protocol)
            assert list(ours.parameters) == list(theirs.parameters)[1:], name
