"""How a dead or stuck peer is noticed: a part of control.ZmqDisaggManager, whose transfer
thread calls `Liveness.check` every TICK_SECONDS with the rooms still open.

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
  abort() on either side sends Abort; the peer fails the room with the reason (a prefill
    room that shipped pages fails once the decode answered with its page count, or once
    one of the checks above finds that decode dead: control.ZmqDisaggManager.fail).
"""
from __future__ import annotations

from kvstrata.transfer.disagg.messages import Ping
from kvstrata.transfer.disagg.rooms import Receiver, Sender, is_final


class Liveness:
    """What the manager knows of its peers' health: when each was last heard from and
    (decode) how many pings in a row went unanswered. Runs on the transfer thread only;
    reaches the manager through its public calls (fail, drop_peer, send_to)."""

    def __init__(self, mgr):
        self.mgr = mgr
        self.heard: dict[str, float] = {}   # peer -> last message time
        self.misses: dict[str, int] = {}    # decode: unanswered pings in a row
        self.next_ping = 0.0

    def heard_from(self, endpoint: str, now: float) -> None:
        """Any message is a sign of life (a long transfer does not look like death)."""
        self.heard[endpoint] = now
        self.misses[endpoint] = 0

    def quiet_for(self, endpoints, now: float) -> float:
        """Seconds since the most silent of these peers was last heard from (0 for one
        never heard from: its route is new). Any thread (a read of the transfer thread's
        table)."""
        heard = [self.heard.get(e) for e in endpoints]
        return max((now - t for t in heard if t is not None), default=0.0)

    def forget(self, endpoint: str) -> None:
        self.misses.pop(endpoint, None)
        self.heard.pop(endpoint, None)

    def check(self, rooms: list, now: float) -> None:
        """Fail the rooms that timed out or whose peer went silent; decode: ping."""
        mgr = self.mgr
        silent_after = mgr.heartbeat_interval * (mgr.heartbeat_max_failure + 1)
        dead: set[str] = set()
        for obj in rooms:
            if is_final(obj.state):
                continue
            why = obj.timed_out(now)
            for peer in obj.peers() if why is None and isinstance(obj, Sender) else ():
                if peer in dead or now - self.heard.get(peer, now) > silent_after:
                    dead.add(peer)
                    why = f"decode server {peer} silent for over {silent_after:g} s (dead?)"
                    break
            if why:  # no final page count will come from a peer in such a state
                mgr.fail(obj, why, dead=True)
        for peer in dead:
            mgr.drop_peer(peer)  # and the frames queued for it
        if mgr.role == "decode" and now >= self.next_ping:
            self.next_ping = now + mgr.heartbeat_interval
            self._heartbeat([r for r in rooms if isinstance(r, Receiver)])

    def _heartbeat(self, receivers: list[Receiver]) -> None:
        mgr = self.mgr
        live: dict[str, list[Receiver]] = {}
        for r in receivers:  # the silent prefill ranks too: they watch this server's life
            for peer in () if is_final(r.state) else r.peers():
                live.setdefault(peer, []).append(r)
        for peer, rooms in live.items():
            if self.misses.get(peer, 0) >= mgr.heartbeat_max_failure:
                for r in rooms:
                    mgr.fail(r, f"prefill server {peer} did not answer "
                                f"{self.misses[peer]} heartbeats", quiet=peer)
                mgr.drop_peer(peer)
                continue
            mgr.send_to(peer, Ping(mgr.endpoint))
            self.misses[peer] = self.misses.get(peer, 0) + 1


__all__ = ["Liveness"]
