"""A tensor-parallel rank other than 0, as its own process (started by
entrypoints/tp_ranks.py): build the runner like every rank, then apply rank 0's steps
(runner/parallel/tp_runner.py) until rank 0 says shutdown or goes away."""
from __future__ import annotations

import logging
import sys

import msgspec

from kvstrata import envs
from kvstrata.config.server_args import ServerArgs
from kvstrata.entrypoints.engine_factory import build_runner
from kvstrata.entrypoints.tp_ranks import placement
from kvstrata.frontend.process_utils import die_with_parent, exit_now, setup_child_logging

logger = logging.getLogger(__name__)


def run_rank(args: ServerArgs, rank: int, init_addr: str) -> int:
    """A rank other than 0: build its runner, then apply rank 0's steps until shutdown."""
    from kvstrata.runner.parallel.tp_runner import (destroy_group, exit_rank_lost,  # noqa: PLC0415
                                                    serve_rank)

    runner, *_ = build_runner(args, placement(args, rank, init_addr))
    joined = runner.tp_rank
    joined.links.beats.start(envs.KVSTRATA_TP_HEARTBEAT_TIMEOUT.get(), exit_rank_lost)
    try:
        serve_rank(runner, joined.links)
    finally:
        joined.links.close()
        runner.shutdown()
        destroy_group()
    return 0


def _debug_exit(rank: int) -> None:
    """KVSTRATA_DEBUG_RANK_EXIT="RANK:CODE": this rank fails before it joins the group."""
    raw = envs.KVSTRATA_DEBUG_RANK_EXIT.get().strip()
    if not raw:
        return
    target, _, code = raw.partition(":")
    if int(target) == rank:
        logger.error("KVSTRATA_DEBUG_RANK_EXIT: rank %d exits with code %s before joining",
                     rank, code)
        exit_now(int(code))


def main(argv: list[str]) -> int:
    die_with_parent()
    rank, init_addr = int(argv[0]), argv[1]
    args = ServerArgs(**msgspec.json.decode(argv[2]))
    setup_child_logging(args, f"tp{rank}")
    _debug_exit(rank)
    try:
        return run_rank(args, rank, init_addr)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        return 1


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
