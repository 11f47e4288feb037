"""argparse flags generated from ServerArgs' fields.

Each field becomes `--field-name` with the field's default, help and choices, so the CLI can
never drift from the dataclass. Bool fields that default to False are `store_true` switches
(SGLang style: `--enable-hierarchical-cache`); the few that default to True get a
`--no-...` negation via BooleanOptionalAction, since a switch that can only set True would be
useless.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from kvstrata.config.server_args import ServerArgs, flag

_GROUP_TITLES = {
    "engine": "model and engine",
    "server": "HTTP server",
    "memory": "memory",
    "scheduling": "scheduling",
    "parallelism": "parallelism",
    "hicache": "prefix cache and hierarchical cache (HiCache)",
    "disaggregation": "prefill/decode disaggregation",
    "speculative": "speculative decoding",
    "sparse": "sparse attention",
}

_CONVERTERS = {"int": int, "float": float, "str": str}


def _converter(type_str: str):
    base = str(type_str).replace(" | None", "").strip()
    try:
        return _CONVERTERS[base]
    except KeyError:
        raise TypeError(f"ServerArgs field type {type_str!r} has no CLI converter") from None


def cli_fields(cls: type = ServerArgs) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def add_cli_args(parser: argparse.ArgumentParser, cls: type = ServerArgs) -> None:
    """Add one flag per ServerArgs field to `parser`, grouped as in the dataclass."""
    groups: dict[str, Any] = {}
    for f in cli_fields(cls):
        group_key = f.metadata.get("group", "engine")
        if group_key not in groups:
            groups[group_key] = parser.add_argument_group(_GROUP_TITLES.get(group_key, group_key))
        group = groups[group_key]
        help_text = f.metadata.get("help", "")
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default}
        if str(f.type) == "bool":
            if f.default:
                kwargs["action"] = argparse.BooleanOptionalAction
                help_text += " (default: on)"
            else:
                kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _converter(f.type)
            if f.metadata.get("choices"):
                kwargs["choices"] = list(f.metadata["choices"])
            help_text += f" (default: {f.default})"
        # '%' would be read by argparse as a format directive.
        group.add_argument(flag(f.name), help=help_text.replace("%", "%%"), **kwargs)


def server_args_from_namespace(ns: argparse.Namespace, cls: type = ServerArgs) -> ServerArgs:
    """Build ServerArgs from a parsed namespace; attributes that are not fields are ignored,
    so a CLI may add its own flags (e.g. --json) to the same parser."""
    values = {f.name: getattr(ns, f.name) for f in cli_fields(cls) if hasattr(ns, f.name)}
    return cls(**values)
