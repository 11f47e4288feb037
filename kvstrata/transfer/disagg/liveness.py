"""How a dead or stuck peer is noticed: mixed into control.ZmqDisaggManager, whose
transfer thread calls `_tick` every TICK_SECONDS.

A failed room never takes the manager down (the others keep going). A room fails when:
  prefill sender BOOTSTRAPPING longer than KVSTRATA_DISAGG_BOOTSTRAP_TIMEOUT;
  decode receiver BOOTSTRAPPING as long (prefill endpoint never resolved), or not SUCCESS
    KVSTRATA_DISAGG_WAITING_TIMEOUT after init();
  decode pings every prefill it has live rooms with, every KVSTRATA_DISAGG_HEARTBEAT_INTERVAL;
    after KVSTRATA_DISAGG_HEARTBEAT_MAX_FAILURE unanswered pings in a row that peer's rooms
    fail; the prefill fails the rooms of a decode peer silent for (max_failure + 1) intervals
    (any message counts as a sign of life, so a long transfer does not look like death) --
    from the decode's Join on, which it sends as soon as it has found the prefill, so a room
    still waiting in the decode's prealloc queue is covered too;
  decode resolving a prefill whose bootstrap server refuses the connection: after
    KVSTRATA_DISAGG_UNREACHABLE_TIMEOUT (lookup.py), not the bootstrap timeout;
  abort() on either side sends Abort; the peer fails the room with the reason.
"""
from __future__ import annotations

from kvstrata.transfer.disagg.messages import Ping
from kvstrata.transfer.disagg.rooms import Receiver, Sender, is_final


class Liveness:
    """Uses the manager's senders, receivers, _lock, _pending, _heard, _misses, _next_ping,
    role, timeouts, fail(), _send() and _drop_peer()."""

    def _tick(self, now: float) -> None:
        silent_after = self.heartbeat_interval * (self.heartbeat_max_failure + 1)
        with self._lock:
            # Finished rooms stay a while so a late Destination/Chunk still finds them (and
            # learns of a failure); then the manager forgets them (the executor may not).
            for table in (self.senders, self.receivers):
                for room in [r for r, o in table.items() if o.final_at is not None
                             and now - o.final_at > self.bootstrap_timeout]:
                    del table[room]
            rooms = [*self.senders.values(), *self.receivers.values()]
        dead: set[str] = set()
        for obj in rooms:
            if is_final(obj.state):
                continue
            why = obj.timed_out(now)
            if why is None and isinstance(obj, Sender) and obj.peer is not None and (
                    obj.peer in dead or now - self._heard.get(obj.peer, now) > silent_after):
                dead.add(obj.peer)
                why = f"decode server {obj.peer} silent for over {silent_after:g} s (dead?)"
            if why:
                self.fail(obj, why)
        for peer in dead:
            self._drop_peer(peer)  # and the frames queued for it
        for room in [r for r, (_, t) in self._pending.items()
                     if now - t > self.bootstrap_timeout]:
            del self._pending[room]
        if self.role == "decode" and now >= self._next_ping:
            self._next_ping = now + self.heartbeat_interval
            self._heartbeat([r for r in rooms if isinstance(r, Receiver)])

    def _heartbeat(self, receivers: list[Receiver]) -> None:
        live: dict[str, list[Receiver]] = {}
        for r in receivers:
            if r.peer is not None and not is_final(r.state):
                live.setdefault(r.peer, []).append(r)
        for peer, rooms in live.items():
            if self._misses.get(peer, 0) >= self.heartbeat_max_failure:
                for r in rooms:
                    self.fail(r, f"prefill server {peer} did not answer "
                                 f"{self._misses[peer]} heartbeats", tell_peer=False)
                self._drop_peer(peer)
                continue
            self._send(peer, Ping(self.endpoint))
            self._misses[peer] = self._misses.get(peer, 0) + 1


__all__ = ["Liveness"]
