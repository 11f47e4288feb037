"""`kvstrata config --explain`: show what resolution does to a set of serve flags.

For the CLI's command table: `register(("config",), add_explain_args, run_explain, ...)`;
or call `explain_main(argv)` directly. Every serve flag plus --json is accepted; the exit status
is 0 on success and 2 for an invalid combination (the error goes to stderr).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, TextIO

from kvstrata.config.cli_args import add_cli_args, server_args_from_namespace
from kvstrata.config.resolve import platform_for, resolve
from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs
from kvstrata.config.server_args import ServerArgs
from kvstrata.platform import Platform

EXIT_INVALID = 2


def _model_info(args: ServerArgs, model_info: ModelInfo | None) -> ModelInfo | None:
    return model_info if model_info is not None else ModelInfo.from_model_path(args.model_path)


def _record_dsa(info: ModelInfo | None) -> bool:
    # An unknown model might be a DSA one: show the gates and their reasons.
    return info is None or info.uses_dsa


def explain_data(args: ServerArgs, platform: Platform | str | None = None,
                 model_info: ModelInfo | None = None) -> dict[str, Any]:
    """{"resolved": {field: value}, "resolutions": [{field, old, new, rule, reason}]}."""
    info = _model_info(args, model_info)
    resolved, resolutions = resolve(args, platform, info, record_dsa_gates=_record_dsa(info))
    return {"resolved": resolved_dict(resolved),
            "resolutions": [r.to_json() for r in resolutions]}


def resolved_dict(resolved: ResolvedArgs) -> dict[str, Any]:
    return {f.name: getattr(resolved, f.name) for f in dataclasses.fields(resolved)}


def explain(args: ServerArgs, platform: Platform | str | None = None,
            model_info: ModelInfo | None = None, as_json: bool = False) -> str:
    """Human-readable (or JSON) explanation; raises ValueError for an invalid combination."""
    if as_json:
        return json.dumps(explain_data(args, platform, model_info), indent=2, sort_keys=False)
    plat = platform_for(args, platform)
    info = _model_info(args, model_info)
    resolved, resolutions = resolve(args, plat, info, record_dsa_gates=_record_dsa(info))
    return format_table(plat, info, resolved, resolutions)


def format_table(plat: Platform, info: ModelInfo | None, resolved: ResolvedArgs,
                 resolutions: list[Resolution]) -> str:
    model = ("unknown (assuming an MHA model without recurrent state)" if info is None else
             f"kv pool {info.kv_pool_kind}, recurrent state {info.has_recurrent_state}"
             + (f" ({info.recurrent_layers})" if info.recurrent_layers else "") + ", "
             f"dsa {info.uses_dsa}" + (f", windowed layers {info.num_swa_layers} of "
                                       f"{len(info.layer_windows)}" if info.layer_windows
                                       else ""))
    lines = [f"platform: {plat.describe()}", f"model: {model}", ""]
    lines.append(f"resolutions ({len(resolutions)}):")
    if resolutions:
        rows = [("field", "old", "new", "rule", "reason")] + [
            (r.field, repr(r.old), repr(r.new), r.rule,
             ("WARNING: " if r.warning else "") + r.reason) for r in resolutions]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        for row in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row[:4], widths))
                         + "  " + row[4])
    else:
        lines.append("  (none)")
    changed = {r.field for r in resolutions}
    lines += ["", "resolved (* = changed by a rule):"]
    for name, value in resolved_dict(resolved).items():
        lines.append(f"  {'*' if name in changed else ' '} {name} = {value!r}")
    return "\n".join(lines) + "\n"


def add_explain_args(parser: argparse.ArgumentParser) -> None:
    """For the CLI's command table: `kvstrata config --explain [--json] [serve flags]`."""
    parser.add_argument("--explain", action="store_true",
                        help="Print how start-up resolution changes these serve flags.")
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    add_cli_args(parser)


def run_explain(ns: argparse.Namespace, stdout: TextIO | None = None,
                stderr: TextIO | None = None, platform: Platform | None = None) -> int:
    """0 on success; 2 with the error on stderr for an invalid combination. Extra namespace
    attributes (the CLI's own) are ignored. platform: the machine as the CLI found it (with
    a cached --dtype auto measurement), else --platform's or the detected one."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    try:
        args = server_args_from_namespace(ns)
        text = explain(args, platform, as_json=ns.json)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=err)
        return EXIT_INVALID
    out.write(text if text.endswith("\n") else text + "\n")
    return 0


def build_parser(prog: str = "kvstrata config") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Show how start-up resolution "
                                     "turns these serve flags into the running configuration.")
    add_explain_args(parser)
    return parser


def explain_main(argv: list[str] | None = None, stdout: TextIO | None = None,
                 stderr: TextIO | None = None) -> int:
    """Standalone entry: argv are the flags after `kvstrata config` (--explain optional)."""
    return run_explain(build_parser().parse_args(argv), stdout, stderr)


if __name__ == "__main__":
    raise SystemExit(explain_main())
