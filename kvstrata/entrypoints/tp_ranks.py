"""Starting tensor-parallel ranks (issue 23): where they run, how they join, how they end.

Rank 0 is the process that builds the engine (the server's scheduler process, or the
caller of `kvstrata.LLM`); it starts this node's other ranks as child processes of its own
(`python -m kvstrata.entrypoints.tp_worker`), which die with it (PR_SET_PDEATHSIG). With
--nnodes > 1 each other launcher (`serve --node-rank k`) starts its node's ranks and waits
for them. Every rank runs the same start-up (engine_factory.build_runner): resolve the
flags, join the group, load its share, size the KV plan (the budget's minimum over ranks)
and check that every rank's plan is the same.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import msgspec

from kvstrata import envs
from kvstrata.config.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class JoinedRank:
    """What a rank holds once it joined: its placement, model group, links to the other
    ranks, and how to restore the process's core affinity."""
    placement: Any
    group: Any
    links: Any
    restore: Any


def placement(args: ServerArgs, rank: int, init_addr: str, store: Any = None):
    """`store`: rank 0's, already listening at init_addr (rank 0 of one node, tp_comm
    listen_store), else None."""
    from kvstrata.runner.parallel.tp_comm import TPPlacement  # noqa: PLC0415
    return TPPlacement(rank, args.tp_size, init_addr, args.nnodes, args.node_rank,
                       float(args.watchdog_timeout), store)


def spawn_ranks(args: ServerArgs, init_addr: str, ranks: range) -> list[subprocess.Popen]:
    """Start `ranks` as child processes (each builds its runner and serves rank 0's steps)."""
    payload = msgspec.json.encode(dataclasses.asdict(args)).decode()
    return [subprocess.Popen([sys.executable, "-m", "kvstrata.entrypoints.tp_worker", str(r),
                              init_addr, payload]) for r in ranks]


# Flags that may differ between launchers: where each one's own HTTP server would listen.
_PER_NODE = ("node_rank", "host", "port")


def join(args: ServerArgs, p) -> tuple[ServerArgs, Any, JoinedRank]:
    """Pin this rank's cores, join the group, take rank 0's flags (another launcher's
    differing ones are named in a warning: every rank must make the same start-up calls),
    agree on one sampling seed (every rank then draws the same tokens from the same
    logits) and connect the step links. Returns (flags, device, the joined rank)."""
    import torch  # noqa: PLC0415

    from kvstrata.platform import detected_platform  # noqa: PLC0415
    from kvstrata.runner.parallel import tp_comm  # noqa: PLC0415

    device = torch.device(args.device or detected_platform().device_type)
    if device.type == "cuda":  # one GPU per rank of this machine
        device = torch.device("cuda", p.machine_index)
        torch.cuda.set_device(device)
    restore = tp_comm.pin_rank(p.machine_index, p.machine_count)
    group = tp_comm.init_group(p, device, envs.KVSTRATA_TP_SHM_ALLREDUCE.get())
    mine = dataclasses.asdict(args)
    theirs = tp_comm.from_rank0(mine)
    differ = [k for k in theirs if k not in _PER_NODE and theirs[k] != mine.get(k)]
    if differ:
        logger.warning("rank %d: using rank 0's flags; this launcher's differ in %s", p.rank,
                       ", ".join("--" + k.replace("_", "-") for k in differ))
    args = dataclasses.replace(args, **{k: v for k, v in theirs.items() if k not in _PER_NODE})
    seed = args.random_seed if args.random_seed is not None else random.randrange(2**31)
    torch.manual_seed(tp_comm.from_rank0(seed))
    links = tp_comm.RankLinks(p.rank, p.size, tp_comm.advertise_host(p.init_addr))
    return args, device, JoinedRank(p, group, links, restore)


def leave(joined: JoinedRank) -> None:
    """Undo `join` after a failed start-up: close the links, leave the group, give the
    process its cores back."""
    from kvstrata.runner.parallel.tp_runner import destroy_group  # noqa: PLC0415

    joined.links.close()
    destroy_group()
    joined.restore()


def check_same_plan(plan_json: dict) -> None:
    from kvstrata.runner.parallel.tp_comm import all_ranks  # noqa: PLC0415

    plans = all_ranks(plan_json)
    for rank, other in enumerate(plans):
        if other != plans[0]:
            raise RuntimeError(f"tensor parallelism: rank {rank}'s KV plan differs from rank "
                               f"0's: {other} != {plans[0]}")


def serve_node(args: ServerArgs) -> int:
    """`serve --node-rank k` (k > 0): start this node's ranks, wait, exit with the first
    failure's code (rank 0 going away ends them: its heartbeat)."""
    p = placement(args, 0, args.dist_init_addr)
    procs = spawn_ranks(args, args.dist_init_addr, p.local_ranks())
    logger.info("node %d of %d: ranks %s started (pids %s)", args.node_rank, args.nnodes,
                list(p.local_ranks()), [q.pid for q in procs])
    code = 0
    try:
        for q in procs:
            code = q.wait() or code
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    return code
