"""How tensor-parallel ranks find and watch each other (issue 23, the serving path).

Two channels per rank, both from existing libraries:
  - torch.distributed (gloo on CPU, NCCL/RCCL on a GPU) carries the model's collectives and
    the few start-up agreements (the KV budget's minimum, the sampling seed, the plan check);
  - ZMQ carries rank 0's step messages down (one PUSH per rank: queued, never lost to a slow
    joiner) and replies up, plus a heartbeat each way on its own sockets and thread.
Step messages do not ride the gloo group because a gloo wait has one timeout for every op:
an idle server would trip it. Heartbeats make a dead or stopped rank visible within
KVSTRATA_TP_HEARTBEAT_TIMEOUT even while the server is idle (a collective of a step in flight
ends sooner: gloo fails it when the peer's socket closes, or at --watchdog-timeout).
Before any of that, the group forms in wait_for_ranks: a rank that dies or never comes
fails start-up within a poll, or at --dist-timeout, by name.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import zmq

from kvstrata.runner.parallel.tensor_parallel import TPGroup

logger = logging.getLogger(__name__)
HEARTBEAT_INTERVAL_S = 0.5


@dataclass(frozen=True)
class TPPlacement:
    """Where one rank runs: ranks are spread evenly over --nnodes launchers, node k holding
    ranks k * per_node .. (k + 1) * per_node - 1; rank 0 (node 0) runs the scheduler."""
    rank: int
    size: int
    init_addr: str            # host:port of torch.distributed's TCP store (rank 0 serves it)
    nnodes: int = 1
    node_rank: int = 0
    timeout_s: float = 300.0  # a collective waits this long (--watchdog-timeout)
    # Rank 0's store when it is already listening (listen_store), else None: init_group
    # then opens it at init_addr (rank 0 as its server, the others as clients).
    store: Any = field(default=None, compare=False, repr=False)
    join_timeout_s: float = 300.0  # start-up waits this long for every rank (--dist-timeout)
    # A launcher's rank 0 (which started this node's other ranks): raises RankStartError
    # when one of them exited. Called between the short waits for the group to form.
    watch: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def local_index(self) -> int:
        return self.rank - self.node_rank * self.per_node

    def local_ranks(self) -> range:
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    @property
    def on_one_machine(self) -> bool:
        """Several launchers, all on this machine (the store's address is loopback): their
        ranks then share its cores and devices by global rank, not each from core 0."""
        return self.nnodes > 1 and _is_loopback(self.init_addr)

    @property
    def machine_index(self) -> int:
        """This rank's index among the ranks on its machine."""
        return self.rank if self.on_one_machine else self.local_index

    @property
    def machine_count(self) -> int:
        return self.size if self.on_one_machine else self.per_node


def _is_loopback(init_addr: str) -> bool:
    return init_addr.rsplit(":", 1)[0].strip("[]") in ("127.0.0.1", "localhost", "::1")


def advertise_host(init_addr: str) -> str:
    """The address other ranks reach this one at: loopback when the store is local, else
    the interface that routes to the store's host."""
    host = init_addr.rsplit(":", 1)[0].strip("[]")
    if _is_loopback(init_addr):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
        return s.getsockname()[0]


def pin_rank(local_index: int, local_count: int) -> Callable[[], None]:
    """Give each local rank disjoint cores (an even split; round-robin single cores when
    there are fewer cores than ranks) and a torch thread count to match. Returns a function
    that restores the previous affinity and thread count (the offline LLM's rank 0 is the
    caller's own process)."""
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    cores = sorted(before)
    n = len(cores)
    mine = (cores[local_index * n // local_count:(local_index + 1) * n // local_count]
            if n >= local_count else [cores[local_index % n]])
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))

    def restore() -> None:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
    return restore


SHM_SLOT_BYTES = 4 << 20  # per rank and buffer: a 1800-token prefill chunk of width 576


def collectives_backend(device_type: str, nnodes: int, machine: str, shm_free_bytes: int,
                        size: int, allow_shm: bool = True) -> str:
    """Which collectives the model's all-reduce / all-gather use (the rule, tested):
    NCCL on a GPU (RCCL on ROCm); on a CPU, the shared-memory one when every rank is on
    this machine, the CPU is x86 (its store order is what the shared-memory barrier
    relies on) and /dev/shm has room for its buffers twice over; else gloo."""
    if device_type == "cuda":
        return "nccl"
    if device_type != "cpu":
        return "gloo"
    needed = 64 * size + 2 * size * SHM_SLOT_BYTES
    if (allow_shm and nnodes == 1 and machine in ("x86_64", "AMD64", "i686")
            and shm_free_bytes >= 2 * needed):
        return "shm"
    return "gloo"


def shm_free_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def open_shm(rank: int, size: int):
    """The group's shared-memory collectives (a joined torch.distributed group): rank 0
    creates the /dev/shm file, every rank maps it, and the name is unlinked once all have,
    so nothing is left behind even if a rank is killed later."""
    from kvstrata.runner.parallel.shm_allreduce import ShmCollectives  # noqa: PLC0415

    path = from_rank0(ShmCollectives.new_path() if rank == 0 else None)
    shm = ShmCollectives(0, size, path, SHM_SLOT_BYTES, create=True) if rank == 0 else None
    dist.barrier()
    shm = shm or ShmCollectives(rank, size, path, SHM_SLOT_BYTES, create=False)
    dist.barrier()
    if rank == 0:
        os.unlink(path)
    return shm


def listen_store(size: int, timeout_s: float, host: str = "127.0.0.1"
                 ) -> tuple[dist.TCPStore, str]:
    """Rank 0's store on a loopback port the kernel picks as the store binds it, and its
    host:port for the other ranks. (Taking a free port first and binding it later left a
    window in which another process's bind or connection could take it.)"""
    store = dist.TCPStore(host, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, f"{host}:{store.port}"


class RankStartError(RuntimeError):
    """A rank died or never joined the group at start-up; the message names the rank and
    how it ended (or what was waited for, where)."""


JOINED_KEY = "kvstrata/joined/{}"
JOIN_POLL_S = 0.1


def _open_store(p: TPPlacement) -> dist.TCPStore:
    if p.store is not None:
        return p.store
    host, _, port = p.init_addr.rpartition(":")
    try:  # a client retries connecting until the timeout: node 0 may start later
        return dist.TCPStore(host.strip("[]"), int(port), p.size, p.rank == 0,
                             timeout=datetime.timedelta(seconds=p.join_timeout_s),
                             wait_for_workers=False)
    except RuntimeError as e:  # torch's DistNetworkError / DistStoreError
        if p.rank == 0:
            raise  # its own message (e.g. the address is in use) says it
        raise RankStartError(
            f"tensor parallelism: rank {p.rank} could not reach the group's store at "
            f"{p.init_addr} within {p.join_timeout_s:g} s (--dist-timeout): is node 0 "
            "(`kvstrata serve --node-rank 0`) running, and is that address reachable from "
            "here?") from e


def wait_for_ranks(store: dist.Store, p: TPPlacement) -> None:
    """Say that this rank is here, then wait until every rank has said so.

    torch's own rendezvous (in init_process_group) waits in C++ for its whole timeout and
    cannot be woken: a rank that died before reaching it held the others there, silently,
    for --watchdog-timeout. This wait is short polls of the store instead, so that rank 0
    checks the rank processes it started between them (p.watch) and the deadline can name
    the ranks that never came. Afterwards init_process_group's own wait is brief: everyone
    is already at its door."""
    store.set(JOINED_KEY.format(p.rank), str(os.getpid()))
    missing = list(range(p.size))
    deadline = time.monotonic() + p.join_timeout_s
    while True:
        try:
            missing = [r for r in missing if not store.check([JOINED_KEY.format(r)])]
        except RuntimeError as e:  # rank 0's store closed: its start-up failed
            raise RankStartError(f"tensor parallelism: rank {p.rank} lost the group's store "
                                 f"at {p.init_addr} while waiting for ranks {missing} (rank "
                                 "0 stopped its start-up)") from e
        if not missing:
            return
        if p.watch is not None:
            p.watch()
        if time.monotonic() >= deadline:
            raise RankStartError(_not_joined(p, missing))
        time.sleep(JOIN_POLL_S)


def _not_joined(p: TPPlacement, missing: list[int]) -> str:
    msg = (f"tensor parallelism: rank {p.rank} waited {p.join_timeout_s:g} s (--dist-timeout) "
           f"for ranks {missing} to join the group at {p.init_addr}; they never did")
    nodes = sorted({r // p.per_node for r in missing} - {p.node_rank})
    if nodes:  # another launcher's ranks: the likely cause is that launcher, or the network
        msg += (f" (is node {', '.join(map(str, nodes))}'s launcher -- `kvstrata serve "
                f"--nnodes {p.nnodes} --node-rank K --dist-init-addr {p.init_addr}` -- "
                "running, and that address reachable from it?)")
    return msg


def init_group(p: TPPlacement, device: torch.device, allow_shm: bool = True) -> TPGroup:
    import platform  # noqa: PLC0415

    backend = collectives_backend(device.type, p.nnodes, platform.machine(),
                                  shm_free_bytes(), p.size, allow_shm)
    store = _open_store(p)
    wait_for_ranks(store, p)
    dist.init_process_group("nccl" if backend == "nccl" else "gloo", store=store,
                            rank=p.rank, world_size=p.size,
                            timeout=datetime.timedelta(seconds=p.timeout_s))
    group = TPGroup(p.rank, p.size)
    # Every rank judged the same rule on the same machine, but /dev/shm's free space may
    # have moved between them: rank 0's verdict counts.
    if from_rank0(backend) == "shm":
        group.shm = open_shm(p.rank, p.size)
        group.shm.timeout_s = p.timeout_s
    logger.info("tensor parallelism: rank %d of %d, collectives: %s", p.rank, p.size,
                "shared memory (+ gloo for large tensors)" if group.shm else backend)
    return group


def agree_min(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def from_rank0(value):
    """Rank 0's `value` on every rank (a picklable start-up fact: the seed, the plan)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ranks(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class RankLinks:
    """Rank 0 <-> every other rank over ZMQ: `send_all` / `recv` carry step messages down,
    `reply` / `gather` carry answers up; a Heartbeat thread watches the peers."""

    def __init__(self, rank: int, size: int, host: str):
        self.rank, self.size = rank, size
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        inbox_port = self.inbox.bind_to_random_port(f"tcp://{host}")
        beat_in = self.ctx.socket(zmq.PULL)
        beat_port = beat_in.bind_to_random_port(f"tcp://{host}")
        addrs = all_ranks((f"tcp://{host}:{inbox_port}", f"tcp://{host}:{beat_port}"))
        peers = range(1, size) if rank == 0 else [0]
        self.outs = {r: self._push(addrs[r][0]) for r in peers}
        self.beats = Heartbeat(rank, beat_in, {r: self._push(addrs[r][1]) for r in peers})

    def _push(self, addr: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        return s

    def send_all(self, data: bytes) -> None:
        for s in self.outs.values():
            s.send(data, copy=False)

    def recv(self, timeout_s: float | None = None) -> bytes | None:
        if timeout_s is not None and not self.inbox.poll(int(timeout_s * 1000)):
            return None
        return self.inbox.recv()

    def reply(self, data: bytes) -> None:
        self.outs[0].send(data)

    def close(self) -> None:
        self.beats.stop()
        for s in self.outs.values():
            s.close(linger=0)
        self.inbox.close(linger=0)
        self.ctx.term()


class Heartbeat:
    """Every HEARTBEAT_INTERVAL_S: a beat to each peer, the peers' beats read, and each
    peer checked -- a peer silent for `timeout_s`, or a locally started rank process that
    exited, calls `on_lost(reason)` once."""

    def __init__(self, rank: int, inbox: zmq.Socket, peers: dict[int, zmq.Socket]):
        self.rank, self.inbox, self.peers = rank, inbox, peers
        self.timeout_s = 20.0
        self.processes: dict[int, object] = {}  # rank -> Popen of a rank this process started
        self.on_lost: Callable[[str], object] = lambda reason: None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-tp-heartbeat",
                                        daemon=True)

    def start(self, timeout_s: float, on_lost: Callable[[str], object]) -> None:
        self.timeout_s, self.on_lost = timeout_s, on_lost
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for s in (self.inbox, *self.peers.values()):
            s.close(linger=0)

    def _run(self) -> None:
        beat = str(self.rank).encode()
        last = {r: time.monotonic() for r in self.peers}
        while not self._stop.is_set():
            for s in self.peers.values():
                try:
                    s.send(beat, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # a full queue: the peer is not reading, which the check below sees
            deadline = time.monotonic() + HEARTBEAT_INTERVAL_S
            while (wait := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                if self.inbox.poll(int(wait * 1000) + 1):
                    last[int(self.inbox.recv())] = time.monotonic()
            if self._stop.is_set():
                return
            reason = self._lost(last)
            if reason is not None:
                logger.error("tensor parallelism: %s", reason)
                self.on_lost(reason)
                return

    def _lost(self, last: dict[int, float]) -> str | None:
        for r, proc in self.processes.items():
            code = proc.poll()
            if code is not None:
                return f"rank {r} (pid {proc.pid}) exited with code {code}"
        now = time.monotonic()
        for r, t in last.items():
            if now - t > self.timeout_s:
                return f"rank {r} sent no heartbeat for {now - t:.1f} s"
        return None


__all__ = ["TPPlacement", "RankLinks", "Heartbeat", "RankStartError", "advertise_host",
           "pin_rank", "wait_for_ranks", "init_group", "open_shm", "agree_min", "from_rank0",
           "all_ranks"]
