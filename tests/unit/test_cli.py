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


def test_only_the_chosen_command_imports_its_arguments_module():
    """`kvstrata serve` does not import the bench clients (their arguments are added only
    for their own command); the full tree still has every command's arguments."""
    import subprocess
    import sys

    code = ("import sys; from kvstrata.entrypoints.cli import build_parser; "
            "ns = build_parser(sys.argv[1:]).parse_args(sys.argv[1:]); "
            "print(sorted(m for m in sys.modules if m.startswith('kvstrata.bench.')))")
    out = subprocess.run([sys.executable, "-c", code, "serve", "--model-path", "x"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    out = subprocess.run([sys.executable, "-c", code, "bench", "serve", "--base-url", "u", "--model", "m"],
                         capture_output=True, text=True, check=True).stdout
    assert "'kvstrata.bench.serve_client'" in out and "'kvstrata.bench.pd'" not in out


def test_every_command_parses_its_own_flags():
    from kvstrata.entrypoints.cli import build_parser

    full = build_parser()
    ns = full.parse_args(["bench", "serve", "--base-url", "http://x", "--model", "m",
                            "--num-prompts", "3"])
    assert ns.num_prompts == 3
    ns = build_parser(["bench", "pd", "--num-prompts", "5"]).parse_args(
        ["bench", "pd", "--num-prompts", "5"])
    assert ns.num_prompts == 5
