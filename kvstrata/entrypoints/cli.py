"""`kvstrata` command line: `serve`, `bench serve` (and room for `bench offline`,
`config --explain`).

Each command registers itself in COMMANDS as (path, add_arguments, run): the parser is built
from that table, so adding a command is one `register(...)` call in its own module, e.g.

    register(("bench", "offline"), add_offline_args, run_offline, "offline throughput")
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

Command = tuple[tuple[str, ...], Callable[[argparse.ArgumentParser], None],
                Callable[[argparse.Namespace], int], str]
COMMANDS: list[Command] = []


def register(path: tuple[str, ...], add_arguments, run, help_text: str) -> None:
    COMMANDS.append((path, add_arguments, run, help_text))


# ---- serve --------------------------------------------------------------------------------
def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    from kvstrata.config.cli_args import add_cli_args

    add_cli_args(parser)


def _run_serve(ns: argparse.Namespace) -> int:
    from kvstrata.config import refuse_unimplemented
    from kvstrata.config.cli_args import server_args_from_namespace

    try:
        args = server_args_from_namespace(ns)
        refuse_unimplemented(args)
        if args.chat_template:
            from kvstrata.frontend.tokenizer_loader import chat_template_text

            chat_template_text(args.chat_template)  # a bad one fails here, not in a request
    except (NotImplementedError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s [api] %(levelname)s %(name)s: %(message)s")
    from kvstrata import envs

    for name in envs.unknown_variables():
        logging.getLogger("kvstrata").warning("%s is set but is not a kvstrata variable "
                                              "(see docs/configuration.md)", name)
    # Resolution runs once, in the scheduler process, where the model's facts are known; its
    # errors come back as a StartupError and /server_info shows its result.
    from kvstrata.entrypoints.launcher import StartupError, launch_server
    from kvstrata.entrypoints.tp_ranks import serve_node

    from kvstrata.frontend.process_utils import exit_now

    try:
        # --node-rank k > 0: this launcher only runs its node's tensor-parallel ranks
        code = serve_node(args) if args.node_rank > 0 else launch_server(args)
    except StartupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        code = 0
    # The children are stopped and the IPC folder removed: skip the interpreter's teardown.
    exit_now(code)


def _refuse_busy_box(run):
    """A bench run with --require-quiet on a busy box: one clear line and exit 2."""
    def wrapped(ns: argparse.Namespace) -> int:
        from kvstrata.bench.box_load import BusyBoxError

        try:
            return run(ns)
        except BusyBoxError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return wrapped


# ---- bench serve --------------------------------------------------------------------------
def _add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    from kvstrata.bench.serve_client import add_args

    add_args(parser)


def _run_bench_serve(ns: argparse.Namespace) -> int:
    from kvstrata.bench.serve_client import main_from_args

    return main_from_args(ns)


# ---- bench offline / config --explain --------------------------------------------------------
def _add_bench_offline_args(parser: argparse.ArgumentParser) -> None:
    from kvstrata.bench.offline import add_args

    add_args(parser)


def _run_bench_offline(ns: argparse.Namespace) -> int:
    from kvstrata.bench.offline import run

    run(ns)
    return 0


def _run_config(ns: argparse.Namespace) -> int:
    from kvstrata.config.resolve_explain import run_explain

    if not ns.explain:
        print("kvstrata config: nothing to do; pass --explain", file=sys.stderr)
        return 2
    return run_explain(ns, platform=_measured_platform(ns))


def _measured_platform(ns: argparse.Namespace) -> Any:
    """This machine with the --dtype auto verdict serve measured here (runner/cpu/dtype_probe.py,
    from its cache only: explain never measures), or None (--platform simulates, invalid
    flags: run_explain reports those)."""
    from kvstrata import envs
    from kvstrata.config import ModelInfo
    from kvstrata.config.cli_args import server_args_from_namespace
    from kvstrata.config.rules.platform_defaults import wants_probe
    from kvstrata.platform import current_platform

    try:
        args = server_args_from_namespace(ns)
    except (ValueError, TypeError):
        return None
    if args.platform is not None or args.dtype != "auto":
        return None
    plat = current_platform()
    info = ModelInfo.from_model_path(args.model_path)
    try:  # config-only, so explain imports the runner only where a verdict may be cached
        if plat.simulated or not wants_probe(args, plat, info, envs.snapshot()):
            return None
    except ValueError:  # a bad KVSTRATA_* value: resolution reports it
        return None
    from kvstrata.runner.cpu.dtype_probe import measured_platform

    return measured_platform(args, plat, info, cached_only=True)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    from kvstrata.config.resolve_explain import add_explain_args

    add_explain_args(parser)


register(("serve",), _add_serve_args, _run_serve, "run the HTTP server")
register(("bench", "offline"), _add_bench_offline_args, _refuse_busy_box(_run_bench_offline),
         "offline throughput: kvstrata.LLM vs transformers generate")
register(("config",), _add_config_args, _run_config,
         "explain start-up resolution (--explain [--platform P] [--json] [serve flags])")
register(("bench", "serve"), _add_bench_serve_args, _refuse_busy_box(_run_bench_serve),
         "benchmark any OpenAI-compatible server")


def _add_bench_allreduce_args(parser: argparse.ArgumentParser) -> None:
    from kvstrata.bench.allreduce import add_args

    add_args(parser)


def _run_bench_allreduce(ns: argparse.Namespace) -> int:
    from kvstrata.bench.allreduce import run

    run(ns.size, ns.hidden, ns.layers, ns.iters)
    return 0


register(("bench", "allreduce"), _add_bench_allreduce_args, _run_bench_allreduce,
         "tensor parallelism: gloo all-reduce of hidden-size vectors vs memcpy")


def _add_bench_spec_args(parser: argparse.ArgumentParser) -> None:
    from kvstrata.bench.spec import add_args

    add_args(parser)


def _run_bench_spec(ns: argparse.Namespace) -> int:
    from kvstrata.bench.spec import run

    run(ns)
    return 0


register(("bench", "spec"), _add_bench_spec_args, _refuse_busy_box(_run_bench_spec),
         "speculative decoding vs plain decoding (tok/s, TPOT, accept length)")


def _add_bench_pd_args(parser: argparse.ArgumentParser) -> None:
    from kvstrata.bench.pd import add_args

    add_args(parser)


def _run_bench_pd(ns: argparse.Namespace) -> int:
    from kvstrata.bench.pd import run

    run(ns)
    return 0


register(("bench", "pd"), _add_bench_pd_args, _refuse_busy_box(_run_bench_pd),
         "co-located vs prefill/decode disaggregation through sglang-router")


def _add_bench_priority_args(parser: argparse.ArgumentParser) -> None:
    from kvstrata.bench.priority import add_args

    add_args(parser)


def _run_bench_priority(ns: argparse.Namespace) -> int:
    from kvstrata.bench.priority import run

    run(ns)
    return 0


register(("bench", "priority"), _add_bench_priority_args,
         _refuse_busy_box(_run_bench_priority),
         "mixed-priority traffic: TTFT per class with and without preemption")


def _chosen_command(argv: list[str]) -> tuple[str, ...] | None:
    """The registered command that argv's leading words name, if any."""
    words = []
    for arg in argv:
        if arg.startswith("-"):
            break
        words.append(arg)
    for path, *_ in COMMANDS:
        if tuple(words[:len(path)]) == path:
            return path
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command tree; only the command argv names gets its arguments (with argv
    None, every command does). Adding a command's arguments imports its module: the bench
    clients' (aiohttp, numpy, ...) cost `kvstrata serve` ~0.5 s of CPU at every start."""
    chosen = None if argv is None else _chosen_command(argv)
    parser = argparse.ArgumentParser(prog="kvstrata")
    subparsers = {(): parser.add_subparsers(dest="command", required=True)}
    for path, add_arguments, run, help_text in COMMANDS:
        for depth in range(1, len(path)):  # create intermediate groups ("bench")
            prefix = path[:depth]
            if prefix not in subparsers:
                group = subparsers[prefix[:-1]].add_parser(prefix[-1])
                subparsers[prefix] = group.add_subparsers(dest=f"command_{depth}",
                                                          required=True)
        sub = subparsers[path[:-1]].add_parser(path[-1], help=help_text)
        if argv is None or path == chosen:
            add_arguments(sub)
        sub.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser(argv).parse_args(argv)
    return ns._run(ns)


if __name__ == "__main__":
    raise SystemExit(main())
