"""Checks of ServerArgs values (no torch): the range table, type checks and the messages, all
naming the CLI flag ("--page-size must be >= 1, got 0"), and the one parser of the
extra-config JSON. Kept apart from the field list so that server_args.py stays the table of
options."""
from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any


def flag(name: str) -> str:
    """The CLI spelling of a field: page_size -> --page-size (used in every error message)."""
    return "--" + name.replace("_", "-")


def parse_extra_config(value: str | None) -> dict:
    if not value:
        return {}
    if value.startswith("@"):
        with open(value[1:], encoding="utf-8") as fh:
            text = fh.read()
    else:
        text = value
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag('hicache_storage_backend_extra_config')} is not valid JSON: "
                         f"{exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag('hicache_storage_backend_extra_config')} must be a JSON object")
    return parsed


# Range checks: field -> (predicate, requirement text). Kept as data so the message format is
# uniform: "--page-size must be >= 1, got 0".
_RANGES: dict[str, tuple] = {
    "page_size": (lambda v: v >= 1, ">= 1"),
    "nnodes": (lambda v: v >= 1, ">= 1"),
    "node_rank": (lambda v: v >= 0, ">= 0"),
    "port": (lambda v: 1 <= v <= 65535, "in 1..65535"),
    "disaggregation_bootstrap_port": (lambda v: 1 <= v <= 65535, "in 1..65535"),
    "max_total_tokens": (lambda v: v >= 1, ">= 1"),
    "max_running_requests": (lambda v: v >= 1, ">= 1"),
    "max_queued_requests": (lambda v: v >= 1, ">= 1"),
    "priority_scheduling_preemption_threshold": (lambda v: v >= 0, ">= 0"),
    "max_prefill_tokens": (lambda v: v >= 1, ">= 1"),
    "chunked_prefill_size": (lambda v: v == -1 or v >= 1, ">= 1 or -1 (disabled)"),
    "schedule_conservativeness": (lambda v: v > 0, "> 0"),
    "mem_fraction_static": (lambda v: 0 < v < 1, "in (0, 1)"),
    "swa_full_tokens_ratio": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "max_mamba_cache_size": (lambda v: v >= 1, ">= 1"),
    "mamba_full_memory_ratio": (lambda v: v > 0, "> 0"),
    "mamba_track_interval": (lambda v: v >= 1, ">= 1"),
    "context_length": (lambda v: v >= 1, ">= 1"),
    "stream_interval": (lambda v: v >= 1, ">= 1"),
    "watchdog_timeout": (lambda v: v > 0, "> 0"),
    "grammar_timeout": (lambda v: v > 0, "> 0"),
    "dist_timeout": (lambda v: v > 0, "> 0"),
    "tp_size": (lambda v: v >= 1, ">= 1"),
    "dcp_size": (lambda v: v >= 1, ">= 1"),
    "hicache_ratio": (lambda v: v > 0, "> 0"),
    "hicache_size": (lambda v: v >= 0, ">= 0"),
    "num_reserved_decode_tokens": (lambda v: v >= 0, ">= 0"),
    "disaggregation_decode_polling_interval": (lambda v: v >= 1, ">= 1"),
    "disaggregation_decode_extra_slots": (lambda v: v >= 0, ">= 0"),
    "speculative_num_steps": (lambda v: v >= 1, ">= 1"),
    "speculative_disable_by_batch_size": (lambda v: v >= 0, ">= 0"),
    "speculative_eagle_topk": (lambda v: v >= 1, ">= 1"),
    "speculative_num_draft_tokens": (lambda v: v >= 2, ">= 2"),
    "speculative_accept_threshold_single": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "speculative_accept_threshold_acc": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "speculative_ngram_min_match_window_size": (lambda v: v >= 1, ">= 1"),
    "speculative_ngram_max_match_window_size": (lambda v: v >= 1, ">= 1"),
    "speculative_ngram_min_bfs_breadth": (lambda v: v >= 1, ">= 1"),
    "speculative_ngram_max_bfs_breadth": (lambda v: v >= 1, ">= 1"),
    "speculative_ngram_branch_length": (lambda v: v >= 1, ">= 1"),
    "speculative_ngram_capacity": (lambda v: v >= 1, ">= 1"),
}

# The waiting-queue orders that priority scheduling refines (SGLang: the others are refused).
PRIORITY_POLICIES = ("fcfs", "lof")
_NUMERIC = {"int": (int,), "float": (int, float)}


def validate(args) -> None:
    """Every flag's type, choices and range, and the combinations ServerArgs alone can judge
    (ValueError naming the flag); called by ServerArgs on construction."""
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        base = str(f.type).replace(" | None", "")
        if value is None and base != str(f.type):
            continue  # an optional field left unset: resolution decides later
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{flag(f.name)} must be one of {', '.join(choices)}, got {value!r}")
        if base == "bool" and not isinstance(value, bool):
            raise ValueError(f"{flag(f.name)} must be a bool, got {value!r}")
        if base == "str" and not isinstance(value, str):
            raise ValueError(f"{flag(f.name)} must be a string, got {value!r}")
        # bool is an int subclass; True as a page size is a mistake, not 1.
        if base in _NUMERIC and (
                isinstance(value, bool) or not isinstance(value, _NUMERIC[base])):
            raise ValueError(f"{flag(f.name)} must be {base}, got {value!r}")
        if f.name in _RANGES:
            ok, requirement = _RANGES[f.name]
            if not ok(value):
                raise ValueError(f"{flag(f.name)} must be {requirement}, got {value!r}")
    if args.enable_hierarchical_cache and args.disable_radix_cache:
        raise ValueError("--enable-hierarchical-cache and --disable-radix-cache are mutually "
                         "exclusive (HiCache extends the radix cache)")
    if args.enable_priority_scheduling and args.schedule_policy not in PRIORITY_POLICIES:
        raise ValueError(f"--enable-priority-scheduling works with --schedule-policy "
                         f"{' or '.join(PRIORITY_POLICIES)}, got {args.schedule_policy!r}")
    _check_nodes(args)
    extra = args.hicache_storage_backend_extra_config
    if extra and not extra.startswith("@"):
        parse_extra_config(extra)  # fail at construction; @file is read when the backend starts


def _check_nodes(args) -> None:
    if args.node_rank >= args.nnodes:
        raise ValueError(f"--node-rank must be < --nnodes {args.nnodes}, got {args.node_rank}")
    if args.tp_size % args.nnodes:
        raise ValueError(f"--nnodes {args.nnodes} must divide --tp-size {args.tp_size}")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address)")
    if args.dist_init_addr is not None:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"--dist-init-addr must be host:port, got "
                             f"{args.dist_init_addr!r}")


__all__ = ["flag", "parse_extra_config", "validate"]


def reject_unknown_kwargs(cls: type) -> None:
    """Wrap the dataclass's generated __init__ so an unknown keyword (LLM(model_path=...,
    **kwargs) forwards user kwargs to ServerArgs) fails with the names and a suggestion, not
    only Python's generic message."""
    generated_init = cls.__init__
    known = frozenset(f.name for f in dataclasses.fields(cls))

    def checked_init(self, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            parts = []
            for name in unknown:
                close = difflib.get_close_matches(name, known, n=1)
                parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"{cls.__name__} got unknown argument(s): {', '.join(parts)}")
        generated_init(self, *args, **kwargs)

    cls.__init__ = checked_init  # type: ignore[method-assign]
