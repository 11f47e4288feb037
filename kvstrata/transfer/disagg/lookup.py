"""How a decode manager finds a prefill server's data endpoint: mixed into
control.ZmqDisaggManager. One resolver thread per prefill being looked up (through its
bootstrap server, retried until the bootstrap timeout), so a prefill that is down never
delays the rooms of the others; routes are cached per (bootstrap host, port). A room
aborted before its prefill was found (e.g. refused at admission) is told to that prefill
once the look-up ends, so its half fails at once instead of at the bootstrap timeout.
"""
from __future__ import annotations

import socket

from kvstrata.protocol.disagg import KVPoll
from kvstrata.transfer.disagg.bootstrap_server import resolve_prefill_endpoint
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
    @property
    def peer_role(self) -> str:
        return "decode" if self.role == "prefill" else "prefill"

    def abort_when_resolved(self, r) -> None:
        """Transfer thread: a receiver failed before its prefill's endpoint was known."""
        abort = Abort(r.room, self.endpoint, r.reason or "aborted")
        with self._lock:
            endpoint = self._routes.get(r.bootstrap)
            if endpoint is None:
                self._deferred_aborts.setdefault(r.bootstrap, []).append(abort)
                return
        self._send(endpoint, abort)

    def _resolve(self, key: tuple[str, int]) -> None:
        """Resolver thread, one per prefill being looked up (a prefill that is down must
        not delay the rooms of the others): retry until the bootstrap timeout."""
        endpoint, error = resolve_prefill_endpoint(
            key, self.bootstrap_timeout, (self.page_size, self.kv_dtype),
            lambda: self._stopping)
        with self._lock:
            self._resolving.discard(key)
            deferred = self._deferred_aborts.pop(key, [])
            if endpoint is not None:
                self._routes[key] = endpoint
                for abort in deferred:
                    self._call(self._send, endpoint, abort)
            waiting = [r for r in self.receivers.values()
                       if r.bootstrap == key and r.peer is None and not is_final(r.state)]
        for r in waiting:
            if endpoint is None:
                self.transition(r, KVPoll.FAILED,
                                f"prefill at bootstrap {key[0]}:{key[1]} unusable: {error}")
            else:
                r.peer = endpoint
                self.transition(r, KVPoll.WAITING_FOR_INPUT,
                                only_from=(KVPoll.BOOTSTRAPPING,))
                self._call(self.send_join, r)
                self._call(self.send_destination, r)  # if init() came first



__all__ = ["PrefillLookup", "advertised_ip"]
