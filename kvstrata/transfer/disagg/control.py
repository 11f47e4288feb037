"""The control plane shared by the tcp and mooncake backends: one transfer thread per
server owning every zmq socket (a PULL socket bound at the server's data endpoint, one PUSH
socket per peer), the per-room sender/receiver state machines of protocol/disagg.py, and
the timeouts and heartbeat. A backend only says how pages move (`_send_pages` on the
prefill side, `write_pages` on the decode side).

Threads: the runner calls create/init/send/abort/poll; those calls change a state under
`lock` and hand socket work to the transfer thread as a closure (`call_soon`), because zmq
sockets must stay in one thread. The decode side also starts a resolver thread per prefill
it looks up over HTTP (a look-up may retry for long while that prefill starts).

The manager is made of parts, each with its own state, that reach it only through its
public calls (call_soon, send_to, transition, fail, drop_peer, lock): the rooms
(rooms.py), failure detection -- timeouts, heartbeat (liveness.py), and the decode side's
look-up of prefill endpoints (lookup.py). What the thread does with each message that
arrives, and the prefill side's shipping, is a mixin: dispatch.py.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import zmq

from kvstrata import envs
from kvstrata.protocol.disagg import KVPoll
from kvstrata.transfer.disagg.base import DisaggManager, KVReceiver, KVSender
from kvstrata.transfer.disagg.bootstrap_client import register_rank
from kvstrata.transfer.disagg.bootstrap_server import BootstrapServer
from kvstrata.transfer.disagg.dispatch import ControlDispatch
from kvstrata.transfer.disagg.liveness import Liveness
from kvstrata.transfer.disagg.lookup import PrefillLookup, advertised_ip
from kvstrata.transfer.disagg.messages import ENCODER, Chunk, Destination
from kvstrata.transfer.disagg.regions import MAIN, PageRegions
from kvstrata.transfer.disagg.rooms import Receiver, Sender, is_final

logger = logging.getLogger(__name__)
TICK_SECONDS = 0.05      # timeout / heartbeat checks; also the thread's longest sleep


class ZmqDisaggManager(ControlDispatch, DisaggManager):
    def __init__(self, role: str, buffers, *, host: str, bootstrap_port: int,
                 num_metadata_slots: int, page_size: int, kv_dtype: str, tp_rank: int = 0,
                 tp_size: int = 1, kv_replicated: bool = False, swa_buffers=(),
                 state_buffers=()):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self.role, self.page_size, self.kv_dtype = role, page_size, kv_dtype
        # Tensor parallelism: this rank's share of the KV; prefill rank r registers as tp
        # rank r (rank 0 serves the bootstrap server); which prefill rank a decode rank
        # pulls from: rank_map.py (`kv_replicated`: every rank holds the whole KV, MLA).
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.kv_replicated = kv_replicated
        # What peers are told to connect to: a wildcard bind address is no address to dial.
        self.host = advertised_ip(host)
        # `swa_buffers`: the SWA pool's, `state_buffers` the state pool's: page regions of
        # their own (regions.py)
        self.regions = PageRegions(buffers, swa_buffers, state_buffers)
        self.buffers = self.regions.flat
        self.geometry = self.regions.geometry()
        self.num_metadata_slots = num_metadata_slots
        self.bootstrap_timeout = envs.KVSTRATA_DISAGG_BOOTSTRAP_TIMEOUT.get()
        self.waiting_timeout = envs.KVSTRATA_DISAGG_WAITING_TIMEOUT.get()
        self.heartbeat_interval = envs.KVSTRATA_DISAGG_HEARTBEAT_INTERVAL.get()
        self.heartbeat_max_failure = envs.KVSTRATA_DISAGG_HEARTBEAT_MAX_FAILURE.get()

        # Guards the room tables and the look-up's routes (any thread).
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self.senders: dict[int, Sender] = {}
        self.receivers: dict[int, Receiver] = {}
        # Messages for rooms not created yet (prefill: Join/Destination/Abort; a prefill
        # rank may serve several decode ranks), with when the first arrived.
        self._pending: dict[int, tuple[list, float]] = {}
        self.liveness = Liveness(self)
        self.lookup = PrefillLookup(self)  # decode side
        self._peers: dict[str, zmq.Socket] = {}
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = False

        self._ctx = zmq.Context()
        self._bootstrap: BootstrapServer | None = None
        try:
            self._open(host, bootstrap_port)
        except BaseException:  # a taken port, a bootstrap server that did not come up
            if self._bootstrap is not None:
                self._bootstrap.stop()
            with contextlib.suppress(Exception):  # whatever part of it was set up
                self._close_backend()
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name=f"pd-{role}", daemon=True)
        self._thread.start()

    def _open(self, host: str, bootstrap_port: int) -> None:
        """Sockets, the backend's registration, and (prefill) the bootstrap server."""
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        data_port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{self.host}:{data_port}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(f"inproc://pd-wake-{id(self)}")
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(f"inproc://pd-wake-{id(self)}")
        self._wake_lock = threading.Lock()
        self._setup_backend()

        if self.role == "prefill":
            if self.tp_rank == 0:
                self._bootstrap = BootstrapServer(host, bootstrap_port)
                self._bootstrap.start()
            register_rank(self.host, bootstrap_port, {
                "rank_ip": self.host, "rank_port": data_port,
                "page_size": self.page_size, "kv_cache_dtype": self.kv_dtype,
                "attn_tp_size": self.tp_size, "attn_tp_rank": self.tp_rank,
                "attn_cp_size": 1, "attn_cp_rank": 0,
                "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
                "system_dp_size": 1, "system_dp_rank": 0},
                wait_s=self.bootstrap_timeout if self.tp_rank else 0.0)

    # ------------------------------------------------------------------ backend hooks
    def _setup_backend(self) -> None:
        """Register buffers with the data plane (mooncake)."""

    def destination_extras(self) -> dict:
        """Extra Destination fields the prefill needs to write into our buffers."""
        return {}

    def _send_pages(self, s: Sender, dest: Destination, src: list[int], dst: list[int],
                    offset: int, last: bool, metadata, region: int = MAIN) -> None:
        """Transfer thread, prefill: move these pages to `dest` (one of the room's decode
        ranks), then send the Chunk message(s); the final one carries ack=True (and
        last/metadata when `last`)."""
        raise NotImplementedError

    def write_pages(self, r: Receiver, msg: Chunk, frames: list) -> None:
        """Transfer thread, decode: place a chunk's bytes (tcp frames) into r.dst pages."""
        if frames:
            raise ValueError(f"unexpected {len(frames)} data frames")

    # ------------------------------------------------------------------ runner-facing API
    def create_sender(self, bootstrap_host: str, bootstrap_port: int, room: int) -> KVSender:
        s = Sender(self, room)
        with self.lock:
            self.senders[room] = s
        self.call_soon(self._adopt_pending, s)
        return s

    def create_receiver(self, bootstrap_host: str, bootstrap_port: int,
                        room: int) -> KVReceiver:
        r = Receiver(self, room, (bootstrap_host, bootstrap_port))
        with self.lock:
            self.receivers[room] = r
            self.lookup.attach(r)
        return r

    def wait_for_change(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait(timeout)

    def close(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self._wake()
        self._thread.join(timeout=10)
        if self._bootstrap is not None:
            self._bootstrap.stop()
        with self.lock:
            rooms = [*self.senders.values(), *self.receivers.values()]
        for obj in rooms:
            self.transition(obj, KVPoll.FAILED, f"the {self.role} transfer manager closed")
        self._close_backend()
        self._ctx.term()

    def _close_backend(self) -> None:
        pass

    @property
    def page_bytes(self) -> int:
        """Bytes one KV page of the main region takes over its registered buffers."""
        return self.regions.page_bytes(MAIN)

    @property
    def peer_role(self) -> str:
        return "decode" if self.role == "prefill" else "prefill"

    # ------------------------------------------------------------------ the parts' calls
    def transition(self, obj, state: KVPoll, reason: str | None = None,
                   only_from: tuple[KVPoll, ...] | None = None) -> bool:
        """Any thread. Terminal states stick; returns whether the state changed."""
        with self._changed:
            if is_final(obj.state) or obj.state == state or (
                    only_from is not None and obj.state not in only_from):
                return False
            obj.state = state
            if is_final(state):
                obj.final_at = time.monotonic()
            if state == KVPoll.FAILED:
                obj.reason = reason
                logger.warning("PD room %d (%s) failed: %s", obj.room, self.role, reason)
            self._changed.notify_all()
            return True

    def fail(self, obj, reason: str, quiet: str | None = None, dead: bool = False) -> None:
        """Transfer thread: fail the room and tell its peers but `quiet` (the one that told
        us, or one found dead). A sender that shipped pages stays `closing` until the
        decode ranks sent their final counts (rooms.Sender.close), unless a peer is `dead`."""
        if isinstance(obj, Sender) and obj.close(reason, quiet, dead):
            return
        if self.transition(obj, KVPoll.FAILED, reason):
            for peer in obj.peers():
                if peer != quiet:
                    self.send_to(peer, obj.abort_message(peer, reason))

    def call_soon(self, fn, *args) -> None:
        """Any thread: run fn(*args) on the transfer thread (which owns the sockets)."""
        self._cmds.put((fn, args))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_tx.closed:
                with contextlib.suppress(zmq.Again):  # queue full: a wake-up is pending
                    self._wake_tx.send(b"", zmq.NOBLOCK)

    # ------------------------------------------------------------------ the transfer thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_tick = 0.0
        try:
            while not self.stopping:
                ready = dict(poller.poll(int(TICK_SECONDS * 1000)))
                if self._wake_rx in ready:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                while True:
                    try:
                        fn, args = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    self._guarded(fn, *args)
                for _ in range(64 if self._pull in ready else 0):
                    try:
                        frames = self._pull.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._guarded(self._handle, frames)
                now = time.monotonic()
                if now >= next_tick:
                    self._guarded(self._tick, now)
                    next_tick = now + TICK_SECONDS
        finally:
            with self._wake_lock:
                for sock in (self._pull, self._wake_rx, self._wake_tx, *self._peers.values()):
                    sock.close(linger=0)

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # one bad message or room must not stop the thread
            logger.exception("PD %s transfer thread: %s failed", self.role, fn.__name__)
            for obj in args:
                if isinstance(obj, (Sender, Receiver)):
                    self.fail(obj, f"{type(e).__name__}: {e}")

    def _tick(self, now: float) -> None:
        """Finished rooms stay a while so a late Destination/Chunk still finds them (and
        learns of a failure); then the manager forgets them (the executor may not). Early
        messages for rooms never created expire the same way. Then the liveness checks."""
        with self.lock:
            for table in (self.senders, self.receivers):
                for room in [r for r, o in table.items() if o.final_at is not None
                             and now - o.final_at > self.bootstrap_timeout]:
                    del table[room]
            rooms = [*self.senders.values(), *self.receivers.values()]
        for room in [r for r, (_, t) in self._pending.items()
                     if now - t > self.bootstrap_timeout]:
            del self._pending[room]
        self.liveness.check(rooms, now)

    def send_to(self, endpoint: str, msg, frames=()) -> None:
        """Transfer thread: send one message (and its data frames) to a peer."""
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self._peers[endpoint] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block the thread; memory is bounded
            sock.connect(endpoint)          # by the pages the scheduler asked to send
        sock.send_multipart([ENCODER.encode(msg), *frames], copy=False)

    def drop_peer(self, endpoint: str) -> None:
        """Transfer thread: a dead peer: close its socket (and the frames queued for it),
        forget its health and its route."""
        sock = self._peers.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)
        self.liveness.forget(endpoint)
        self.lookup.forget(endpoint)


__all__ = ["ZmqDisaggManager"]
