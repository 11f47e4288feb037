"""The runner's executor registry and the engine's side classes are the one list the model
runner, TP's event merger and the metrics read: a new executor's events are merged under
tensor parallelism, and a new side's counters are exported, without an edit elsewhere."""
from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

from prometheus_client import generate_latest

from kvstrata.engine.sides import registry as side_registry
from kvstrata.metrics import ServerMetrics
from kvstrata.runner import model_runner
from kvstrata.runner.executors import registry
from kvstrata.runner.executors.base import OpExecutor
from kvstrata.runner.executors.tp_merge import EventMerge
from kvstrata.runner.parallel.tp_events import EventMerger


@dataclass(frozen=True)
class _Ping:
    key: int
    value: int


class _MaxOfRanks(EventMerge):
    event_type = _Ping

    def __init__(self, size):
        super().__init__(size)
        self.seen: dict[int, dict[int, int]] = {}

    def add(self, rank, event):
        self.seen.setdefault(event.key, {})[rank] = event.value
        return event.key

    def emit(self, key):
        values = self.seen.get(key, {})
        return _Ping(key, max(values.values())) if len(values) == self.size else None


class _PingExecutor(OpExecutor):
    event_merges = (_MaxOfRanks,)


def test_a_registered_executors_events_are_merged_under_tp(monkeypatch):
    monkeypatch.setitem(registry.EXECUTORS, "ping", _PingExecutor)
    merger = EventMerger(2)
    assert merger.merge([[_Ping(1, 3)], []]) == []  # rank 1 has not said yet
    assert merger.merge([[], [_Ping(1, 5)]]) == [_Ping(1, 5)]
    assert merger.merge([["other"], ["ignored"]]) == ["other"]  # no rule: rank 0's


def test_the_runner_applies_executors_in_registry_order():
    """ModelRunner.executors() reads EXECUTORS (no list of its own), and every registered
    name is an attribute ModelRunner.__init__ sets."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(model_runner.ModelRunner.__init__)))
    assigned = {node.target.attr if isinstance(node, ast.AnnAssign) else t.attr
                for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Attribute)}
    assert set(registry.EXECUTORS) <= assigned
    assert "EXECUTORS" in inspect.getsource(model_runner.ModelRunner.executors)

    class Fake:
        backup, hicache, disagg = None, "h", "d"
    assert model_runner.ModelRunner.executors(Fake()) == ["h", "d"]


def test_every_buildable_side_is_registered_and_its_counters_exported():
    built = {n.id for n in ast.walk(ast.parse(inspect.getsource(side_registry)))
             if isinstance(n, ast.Name) and n.id.endswith(("Side", "Disagg"))}
    built -= {"SchedulerSide", "DisaggSide"}
    assert built == {cls.__name__ for cls in side_registry.SIDE_CLASSES}
    counters = side_registry.side_counters()
    assert {"num_preempted_reqs", "spec_verify_steps", "disagg_kv_bytes_sent_total",
            "disagg_kv_bytes_received_total"} <= set(counters)
    metrics = ServerMetrics("m", side_counters=counters)
    metrics.set_load({"num_preempted_reqs": 2, "disagg_kv_bytes_sent_total": 10})
    metrics.set_load({"num_preempted_reqs": 3, "disagg_kv_bytes_sent_total": 10})
    text = generate_latest(metrics.registry).decode()
    assert 'kvstrata:num_preempted_reqs_total{model_name="m"} 3.0' in text
    assert 'kvstrata:disagg_kv_bytes_sent_total{model_name="m"} 10.0' in text
