"""How a decode manager finds a prefill server's data endpoint: a part of
control.ZmqDisaggManager. One resolver thread per prefill being looked up (through its
bootstrap server, retried until the bootstrap timeout), so a prefill that is down never
delays the rooms of the others; routes are cached per (bootstrap host, port) while the
prefill keeps talking (a quiet one is looked up again: it may have restarted). A room
aborted before its prefill was found (e.g. refused at admission) is told to that prefill
once the look-up ends, so its half fails at once instead of at the bootstrap timeout.
"""
from __future__ import annotations

import socket
import threading
import time

from kvstrata.protocol.disagg import KVPoll
from kvstrata.transfer.disagg.bootstrap_client import PrefillRoute, resolve_prefill_route
from kvstrata.transfer.disagg.messages import Abort
from kvstrata.transfer.disagg.rooms import is_final


def advertised_ip(host: str) -> str:
    """`host`, or for a wildcard (0.0.0.0, ::, empty) this machine's outbound IP (the
    address a UDP socket would send from; nothing is sent), else 127.0.0.1."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class PrefillLookup:
    """The decode side's routes (bootstrap address -> the prefill's data endpoint), the
    look-ups under way, and the aborts waiting for one. Its tables are guarded by the
    manager's `lock` (create_receiver attaches a receiver and its route atomically)."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.routes: dict[tuple[str, int], PrefillRoute] = {}
        self.resolving: set[tuple[str, int]] = set()
        self.deferred_aborts: dict[tuple[str, int], list[Abort]] = {}

    def attach(self, r) -> None:
        """Under mgr.lock: route a new receiver to its prefill if known, else look it up.
        A route whose prefill went quiet (no room with it for over two heartbeat intervals)
        is looked up again: a prefill restarted on the same bootstrap port has new data
        ports, and a request sent to the old ones would fail only at the heartbeat bound."""
        route = self.routes.get(r.bootstrap)
        if route is not None and self.mgr.liveness.quiet_for(route.endpoints, time.monotonic()) \
                > 2 * self.mgr.heartbeat_interval:
            del self.routes[r.bootstrap]
            route = None
        if route is not None:
            r.set_route(route)
            r.state = KVPoll.WAITING_FOR_INPUT
            self.mgr.call_soon(r.send_join)
        elif r.bootstrap not in self.resolving:
            self.resolving.add(r.bootstrap)
            threading.Thread(target=self._resolve, args=(r.bootstrap,), daemon=True,
                             name="pd-resolve").start()

    def forget(self, endpoint: str) -> None:
        """A dead peer: the next room looks it up again."""
        with self.mgr.lock:
            for key in [k for k, route in self.routes.items() if endpoint in route.endpoints]:
                del self.routes[key]

    def abort_when_resolved(self, r) -> None:
        """Transfer thread: a receiver failed before its prefill's endpoint was known."""
        mgr = self.mgr
        abort = Abort(r.room, mgr.endpoint, r.reason or "aborted")
        with mgr.lock:
            route = self.routes.get(r.bootstrap)
            if route is None:
                self.deferred_aborts.setdefault(r.bootstrap, []).append(abort)
                return
        for endpoint in route.endpoints:
            mgr.send_to(endpoint, abort)

    def _resolve(self, key: tuple[str, int]) -> None:
        """Resolver thread, one per prefill being looked up (a prefill that is down must
        not delay the rooms of the others): retry until the bootstrap timeout."""
        mgr = self.mgr
        refused: list[str] = []  # a prefill that answered but does not fit this decode
        route, error = resolve_prefill_route(
            key, mgr.bootstrap_timeout, (mgr.page_size, mgr.kv_dtype), lambda: mgr.stopping,
            tp=(mgr.tp_rank, mgr.tp_size), kv_replicated=mgr.kv_replicated,
            on_refused=refused.append, swa=len(mgr.regions.groups) > 1)
        with mgr.lock:
            self.resolving.discard(key)
            deferred = self.deferred_aborts.pop(key, [])
            if route is not None:
                self.routes[key] = route
            for abort in deferred:
                for endpoint in route.endpoints if route is not None else refused[:1]:
                    mgr.call_soon(mgr.send_to, endpoint, abort)
            waiting = [r for r in mgr.receivers.values()
                       if r.bootstrap == key and r.peer is None and not is_final(r.state)]
        for r in waiting:
            if route is None:
                reason = f"prefill at bootstrap {key[0]}:{key[1]} unusable: {error}"
                if refused:  # its half of the room fails now too
                    mgr.call_soon(mgr.send_to, refused[0], Abort(r.room, mgr.endpoint, reason))
                mgr.transition(r, KVPoll.FAILED, reason)
            else:
                with mgr.lock:
                    r.set_route(route)
                mgr.transition(r, KVPoll.WAITING_FOR_INPUT, only_from=(KVPoll.BOOTSTRAPPING,))
                mgr.call_soon(r.send_join)
                mgr.call_soon(r.send_destination)  # if init() came first


__all__ = ["PrefillLookup", "advertised_ip"]
