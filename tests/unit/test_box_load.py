"""Benchmarks announce the box's load: a busy box gets a loud warning, or a refusal with
--require-quiet (exit 2 from the CLI), and the JSON records it."""
from __future__ import annotations

import io

import pytest

from kvstrata.bench.box_load import BusyBoxError, announce_load, box_load
from kvstrata.entrypoints import cli


def test_quiet_box_prints_load_only():
    out = io.StringIO()
    info = announce_load(loadavg=(0.4, 0.3, 0.2), cpus=2, stream=out)
    assert info == {"loadavg": [0.4, 0.3, 0.2], "cpus": 2, "busy_limit": 1.0, "busy": False}
    assert "BUSY" not in out.getvalue() and "0.40 0.30 0.20 on 2 CPUs" in out.getvalue()


def test_busy_box_warns_loudly_or_refuses():
    out = io.StringIO()
    info = announce_load(loadavg=(3.5, 2.0, 1.0), cpus=2, stream=out)
    assert info["busy"] and "BUSY BOX: load average 3.50 > 1.00" in out.getvalue()
    with pytest.raises(BusyBoxError, match="refusing to run"):
        announce_load(True, loadavg=(3.5, 2.0, 1.0), cpus=2, stream=io.StringIO())


def test_threshold_comes_from_the_env(monkeypatch):
    monkeypatch.setenv("KVSTRATA_BENCH_MAX_LOAD", "2")
    assert not box_load((3.5, 0, 0), cpus=2)["busy"]
    monkeypatch.setenv("KVSTRATA_BENCH_MAX_LOAD", "1")
    assert box_load((3.5, 0, 0), cpus=2)["busy"]


def test_cli_bench_refuses_on_a_busy_box(monkeypatch, capsys):
    monkeypatch.setenv("KVSTRATA_BENCH_MAX_LOAD", "-1")  # any load is "busy"
    rc = cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--model", "m",
                   "--require-quiet"])
    assert rc == 2
    assert "error: BUSY BOX" in capsys.readouterr().err
