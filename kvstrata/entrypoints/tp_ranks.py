"""Starting tensor-parallel ranks (issue 23): where they run, how they join, how they end.

Rank 0 is the process that builds the engine (the server's scheduler process, or the
caller of `kvstrata.LLM`); it starts this node's other ranks as child processes of its own
(`python -m kvstrata.entrypoints.tp_worker`), which die with it (PR_SET_PDEATHSIG). With
--nnodes > 1 each other launcher (`serve --node-rank k`) starts its node's ranks and waits
for them. Every rank runs the same start-up (engine_factory.build_runner): resolve the
flags, join the group, load its share, size the KV plan (the budget's minimum over ranks)
and check that every rank's plan is the same. A rank's stderr passes through the process
that started it (RankProcess), which keeps its last lines: a rank that dies during start-up
fails it at once, named with its exit code and those lines (watch_ranks, stop_ranks).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
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
                       float(args.watchdog_timeout), store,
                       float(args.dist_timeout or args.watchdog_timeout))


TAIL_LINES = 20        # a dead rank's last stderr lines kept for the error naming it
TAIL_LINE_CHARS = 400


class RankProcess(subprocess.Popen):
    """A rank's process whose stderr this process reads and passes on to its own (fd 2,
    where the rank wrote directly before), keeping the last TAIL_LINES lines: when the rank
    dies, the error that names it can say what it last printed."""

    def __init__(self, rank: int, cmd: list[str]):
        super().__init__(cmd, stderr=subprocess.PIPE)
        self.rank = rank
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._reader = threading.Thread(target=self._pass_on, name=f"kvstrata-tp{rank}-stderr",
                                        daemon=True)
        self._reader.start()

    def _pass_on(self) -> None:
        # Whatever arrives, at once (a progress bar redraws with \r, no newline); the tail
        # is kept in lines.
        partial = b""
        while chunk := self.stderr.read1(1 << 16):
            out = chunk
            try:
                while out:
                    out = out[os.write(2, out):]
            except OSError:
                pass  # our stderr is gone: keep draining, so the rank never blocks on it
            *lines, partial = (partial + chunk).replace(b"\r", b"\n").split(b"\n")
            self._keep(lines)
            partial = partial[-TAIL_LINE_CHARS:]
        self._keep([partial])
        self.stderr.close()

    def _keep(self, lines: list[bytes]) -> None:
        for line in lines:
            if line.strip():
                self.tail.append(line.decode(errors="replace").rstrip()[:TAIL_LINE_CHARS])

    def describe(self, when: str = "") -> str:
        """How the (exited) rank ended: its exit code or signal, and its last lines."""
        self._reader.join(2.0)  # what it wrote just before dying may still be in the pipe
        code = self.returncode
        how = f"exited with code {code}"
        if code is not None and code < 0:
            try:
                how += f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        lines = ("; its last lines on stderr:\n" + "\n".join("  | " + t for t in self.tail)
                 if self.tail else "; it printed nothing")
        return f"rank {self.rank} (pid {self.pid}) {how}{when}{lines}"


def spawn_ranks(args: ServerArgs, init_addr: str, ranks: range) -> list[RankProcess]:
    """Start `ranks` as child processes (each builds its runner and serves rank 0's steps)."""
    payload = msgspec.json.encode(dataclasses.asdict(args)).decode()
    return [RankProcess(r, [sys.executable, "-m", "kvstrata.entrypoints.tp_worker", str(r),
                            init_addr, payload]) for r in ranks]


def watch_ranks(procs: list[RankProcess]) -> Callable[[], None]:
    """What rank 0 calls while it waits for the group to form (TPPlacement.watch): a rank
    process that exited (poll() reaps it) fails start-up now, not at --dist-timeout."""
    def check() -> None:
        from kvstrata.runner.parallel.tp_comm import RankStartError  # noqa: PLC0415

        for q in procs:
            if q.poll() is not None:
                raise RankStartError("tensor parallelism: start-up stops: " + q.describe(
                    " before it joined the group"))
    return check


def stop_ranks(procs: list[RankProcess], error: BaseException) -> BaseException:
    """After rank 0's start-up failed: kill and reap the rank processes, and return the
    error to raise: `error` itself, or, when some rank had exited, `error` followed by how
    each of those ended (a collective with a dead peer fails with torch's bare connection
    error; the rank's own last lines say why it died -- or that it saw rank 0 leave)."""
    from kvstrata.runner.parallel.tp_comm import RankStartError  # noqa: PLC0415

    dead = [q for q in procs if q.poll() is not None]
    for q in procs:
        if q.poll() is None:
            q.kill()
        q.wait()
    if not dead or isinstance(error, (RankStartError, ValueError, NotImplementedError,
                                      KeyboardInterrupt)):
        return error  # ours to report, or the user's flags: every rank refused them
    reasons = "\n".join(q.describe(" during start-up") for q in dead)
    new = RankStartError(f"tensor parallelism: start-up failed: {type(error).__name__}: "
                         f"{error}\n{reasons}")
    new.__cause__ = error
    return new


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
    try:
        args, group, links = _meet(args, p, device)
    except BaseException:
        # e.g. a rank died before joining: leave the group if it formed, and give the
        # process (the offline LLM's caller) its cores back
        from kvstrata.runner.parallel.tp_runner import destroy_group  # noqa: PLC0415

        destroy_group()
        restore()
        raise
    return args, device, JoinedRank(p, group, links, restore)


def _meet(args: ServerArgs, p, device) -> tuple[ServerArgs, Any, Any]:
    """join's part after pinning: (rank 0's flags, the model group, the step links)."""
    import torch  # noqa: PLC0415

    from kvstrata.runner.parallel import tp_comm  # noqa: PLC0415

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
    return args, group, links


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
    """`serve --node-rank k` (k > 0): start this node's ranks and wait; the first that
    fails ends the others (they would only wait for it) and this launcher, with its code,
    naming it. Rank 0 going away ends them: its heartbeat, or the store at start-up."""
    p = placement(args, 0, args.dist_init_addr)
    procs = spawn_ranks(args, args.dist_init_addr, p.local_ranks())
    logger.info("node %d of %d: ranks %s started (pids %s)", args.node_rank, args.nnodes,
                list(p.local_ranks()), [q.pid for q in procs])
    try:
        while True:
            failed = next((q for q in procs if q.poll() not in (None, 0)), None)
            if failed is not None:
                logger.error("node %d: %s", args.node_rank, failed.describe())
                code = failed.returncode
                return code if code > 0 else 128 - code  # a signal: the shell's 128 + N
            if all(q.returncode == 0 for q in procs):
                return 0
            time.sleep(0.2)
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
            q.wait()
