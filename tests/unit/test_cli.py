"""The CLI's command table: config --explain through the real entry point."""
from __future__ import annotations

import json

from kvstrata.entrypoints.cli import main


def test_config_explain_json(capsys):
    assert main(["config", "--explain", "--json", "--platform", "cuda",
                 "--enable-hierarchical-cache", "--hicache-mem-layout", "page_first_direct"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["resolved"]["hicache_io_backend"] == "direct"  # R1
    assert any(r["rule"] == "hicache.layout_io.R1" for r in data["resolutions"])


def test_config_explain_invalid_combination_exits_2(capsys):
    assert main(["config", "--explain", "--enable-hierarchical-cache", "--hicache-mem-layout",
                 "page_head", "--hicache-io-backend", "direct"]) == 2
    assert "page_head" in capsys.readouterr().err


def test_config_without_explain_is_an_error(capsys):
    assert main(["config"]) == 2
