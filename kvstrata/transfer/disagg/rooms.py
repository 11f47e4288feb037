"""Per-room state of the tcp/mooncake backends: the KVSender (prefill) and KVReceiver
(decode) the runner polls. Their methods run on the runner's thread: they validate, change
the state under the manager's lock and hand socket work to the transfer thread
(control.py); the transfer thread fills in what arrives (dest, received, metadata) -- the
receiver's handshake and chunk handling (send_join, send_destination, on_chunk) are its.
"""
from __future__ import annotations

import time

from kvstrata.protocol.disagg import KVPoll, PDMetadata
from kvstrata.transfer.disagg.base import KVReceiver, KVSender
from kvstrata.transfer.disagg.messages import Abort, Ack, Chunk, Destination, Join
from kvstrata.transfer.disagg.regions import STATE, SWA, geometry_bases, region_count

_FINAL = (KVPoll.FAILED, KVPoll.SUCCESS)


def is_final(state: KVPoll) -> bool:
    return state in _FINAL


class _Room:
    def __init__(self, mgr, room: int):
        self.mgr, self.room = mgr, room
        self.state = KVPoll.BOOTSTRAPPING
        self.reason: str | None = None
        self.metadata_index = -1
        self.created = time.monotonic()
        self.final_at: float | None = None  # when it reached SUCCESS or FAILED

    def peers(self) -> list[str]:
        """The other server's data endpoints this room talks to, once known."""
        raise NotImplementedError

    def poll(self) -> KVPoll:
        return self.state

    @property
    def failure_reason(self) -> str | None:
        return self.reason

    def abort(self, reason: str = "aborted") -> None:
        if self.mgr.transition(self, KVPoll.FAILED, reason):
            self.mgr.call_soon(self._tell_peer)

    def abort_message(self, peer: str, reason: str) -> Abort:
        return Abort(self.room, self.mgr.endpoint, reason)

    def _tell_peer(self) -> None:  # transfer thread
        for peer in self.peers():
            self.mgr.send_to(peer, self.abort_message(peer, self.reason or ""))
        if not self.peers() and isinstance(self, Receiver):
            # Aborted before the prefill's endpoint was known (e.g. refused at admission):
            # the prefill still waits for this room, so tell it once the look-up ends.
            self.mgr.lookup.abort_when_resolved(self)

    def _bad_input(self, page_ids: list[int], metadata_index: int | None) -> str | None:
        """Why these pages / this slot are not ours to use, or None."""
        regions = self.mgr.regions
        bad = [p for p in page_ids if not regions.valid(p)]
        if bad:
            return (f"page ids {bad[:8]} outside the registered pages (regions from "
                    f"{regions.bases}, {regions.pages} pages each, page 0 of each reserved)")
        if metadata_index is not None and not 0 <= metadata_index < self.mgr.num_metadata_slots:
            return (f"metadata index {metadata_index} outside 0..."
                    f"{self.mgr.num_metadata_slots - 1}")
        return None


class Sender(_Room, KVSender):
    """Under tensor parallelism at different sizes (rank_map.py) one prefill rank may send
    the room to `fanout` decode ranks (each its own Destination, the same page ids), or be
    told by a decode rank that nothing is wanted from it (a `silent` Destination).

    Pages moved are the ones the decode confirmed (messages.py): a room that fails after
    shipping pages first tells its decode peers and stays `closing` (its pages held, nothing
    more shipped) until each answered with its final count -- or is found dead (liveness) --
    and only then reports FAILED. So the count is the decode's, and no page the prefill
    still ships from is freed while a decode may read it."""

    @property
    def pages_moved(self) -> int:
        """The pages the decode side confirmed it wrote (the most any of its ranks did)."""
        return max((n for e, n in self.confirmed.items() if e in self.shipped), default=0)

    @property
    def swa_pages_moved(self) -> int:
        """Of those, the SWA region's: the decode writes its pages in destination order."""
        return self._moved_in(SWA)

    @property
    def state_pages_moved(self) -> int:
        """Of those, the state region's (recurrent state)."""
        return self._moved_in(STATE)

    def _moved_in(self, region: int) -> int:
        dest = self.dest
        if dest is None:
            return 0
        return region_count(dest.page_ids[:self.pages_moved], geometry_bases(dest.geometry),
                            region)

    def __init__(self, mgr, room: int):
        super().__init__(mgr, room)
        self.joined: list[str] = []      # decode endpoints of this room, in order of arrival
        self.fanout = 1                  # how many Destinations to wait for
        self.dests: dict[str, Destination] = {}  # by decode endpoint, silent ones included
        self.acked: set[str] = set()     # decode endpoints that acknowledged everything
        self.num_pages: int | None = None
        self.sent = 0                    # pages shipped so far (= next destination index)
        self.skipped = 0                 # pages not shipped: the decode holds them already
        self.swa_skipped = 0             # ... of them SWA pages (its prefix_swa_pages)
        self.queued: list[tuple] = []    # send() calls made before the destinations arrived
        self.sends = 0                   # send() calls accepted (runner thread)
        self.shipped: set[str] = set()   # decode endpoints sent pages (transfer thread)
        self.confirmed: dict[str, int] = {}  # decode endpoint -> pages it said it wrote
        self.final: set[str] = set()     # decode endpoints whose count is final
        self.closing: str | None = None  # failed, waiting for the decode's final counts
        self.closing_since = 0.0
        self.aborted = False             # abort() called: ship nothing not shipped yet

    def peers(self) -> list[str]:
        return list(self.joined)

    @property
    def peer(self) -> str | None:
        return self.joined[0] if self.joined else None

    @property
    def receivers(self) -> list[Destination]:
        """The Destinations that want pages (all with the same page ids)."""
        return [d for d in self.dests.values() if not d.silent]

    @property
    def dest(self) -> Destination | None:
        wanted = self.receivers
        return wanted[0] if wanted else None

    @property
    def ready(self) -> bool:
        return len(self.dests) >= self.fanout

    def all_acked(self) -> bool:
        return self.ready and all(d.endpoint in self.acked for d in self.receivers)

    def confirm(self, endpoint: str, pages: int, final: bool) -> None:
        """Transfer thread: a decode rank's count (Ack, Abort); frozen once this room ends."""
        if is_final(self.state):
            return
        self.confirmed[endpoint] = max(self.confirmed.get(endpoint, 0), pages)
        if final:
            self.final.add(endpoint)

    def awaiting(self) -> list[str]:
        """The decode ranks sent pages whose final count has not arrived."""
        return [e for e in self.shipped if e not in self.final]

    def close(self, reason: str, quiet: str | None, dead: bool) -> bool:
        """Transfer thread, from mgr.fail: wait for the final counts of the decode ranks
        sent pages (tell them, once), or end a wait that is over; False: fail as usual."""
        mgr = self.mgr
        if is_final(self.state) or (self.closing is None and (dead or not self.awaiting())):
            return False
        if not dead and self.awaiting():
            if self.closing is None:
                self.closing, self.closing_since = reason, time.monotonic()
                for peer in self.peers():
                    if peer != quiet:
                        mgr.send_to(peer, Abort(self.room, mgr.endpoint, reason))
            return True
        # every count is in, or a peer is dead: the peers were told when it began closing
        mgr.transition(self, KVPoll.FAILED, reason if dead else self.closing)
        return True

    def abort(self, reason: str = "aborted") -> None:
        if not self.sends:  # nothing can have been shipped: no count to wait for
            super().abort(reason)
        elif not is_final(self.state):  # on the transfer thread (after a ship under way)
            self.aborted = True
            self.mgr.call_soon(self.mgr.fail, self, reason)

    def init(self, num_pages: int, metadata_index: int) -> None:
        why = self._bad_input([], metadata_index)
        if why:
            self.abort(why)
            return
        self.num_pages, self.metadata_index = num_pages, metadata_index
        self.mgr.call_soon(self._check_count)

    def _check_count(self) -> None:  # transfer thread
        why = self.page_count_error()
        if why:
            self.mgr.fail(self, why)

    def page_count_error(self) -> str | None:
        first = self.dest
        for other in self.receivers[1:]:
            if (other.page_ids, other.prefix_pages, other.prefix_swa_pages) != (
                    first.page_ids, first.prefix_pages, first.prefix_swa_pages):
                return (f"decode ranks reserved different pages for room {self.room} "
                        f"({first.endpoint}: {len(first.page_ids)} from {first.prefix_pages}, "
                        f"{other.endpoint}: {len(other.page_ids)} from {other.prefix_pages})")
        held_pages = None if self.dest is None else \
            self.dest.prefix_pages + self.dest.prefix_swa_pages
        if self.dest is not None and self.num_pages is not None and \
                self.num_pages != held_pages + len(self.dest.page_ids):
            held = f"holds {held_pages} and " if held_pages else ""
            return (f"prefill will send {self.num_pages} pages but the decode server "
                    f"{held}reserved {len(self.dest.page_ids)}")
        return None

    def send(self, page_ids: list[int], last: bool, metadata: PDMetadata | None = None) -> None:
        why = self._bad_input(page_ids, None)
        if why:
            self.abort(why)
            return
        self.sends += 1
        self.mgr.transition(self, KVPoll.TRANSFERRING)
        self.mgr.call_soon(self.mgr.ship, self, list(page_ids), last, metadata)

    def timed_out(self, now: float) -> str | None:
        bound = self.mgr.heartbeat_interval * (self.mgr.heartbeat_max_failure + 1)
        if self.closing is not None and now - self.closing_since > bound:
            return (f"{self.closing} (no final page count from the decode server within "
                    f"{bound:g} s)")  # e.g. lost with a socket the decode dropped
        if self.state == KVPoll.BOOTSTRAPPING and now - self.created > \
                self.mgr.bootstrap_timeout:
            got = f" ({len(self.dests)} of {self.fanout} decode ranks did)" \
                if self.fanout > 1 else ""
            return (f"the decode server sent no destination for room {self.room} within "
                    f"{self.mgr.bootstrap_timeout:g} s (bootstrap timeout){got}")
        return None


class Receiver(_Room, KVReceiver):
    @property
    def pages_moved(self) -> int:
        """Pages written into the reserved pages while the room was live (frozen once it
        ended: what this side's PDEvent reports and its Abort tells the prefill)."""
        return self.received

    @property
    def swa_pages_moved(self) -> int:
        return region_count((self.dst or [])[:self.received], self.mgr.regions.bases, SWA)

    @property
    def state_pages_moved(self) -> int:
        return region_count((self.dst or [])[:self.received], self.mgr.regions.bases, STATE)

    def abort_message(self, peer: str, reason: str) -> Abort:
        return Abort(self.room, self.mgr.endpoint, reason,
                     self.received if peer == self.peer else 0)

    def __init__(self, mgr, room: int, bootstrap: tuple[str, int]):
        super().__init__(mgr, room)
        self.bootstrap = bootstrap       # the prefill's bootstrap server (host, port)
        self.peer: str | None = None     # the prefill rank that sends the pages, once known
        self.fanout = 1                  # how many decode ranks that rank sends to
        self.silent: tuple[str, ...] = ()  # prefill ranks told that nothing is wanted
        self.dst: list[int] | None = None
        self.prefix_pages = 0            # the prompt's first pages held here already
        self.prefix_swa_pages = 0        # ... and the first of the SWA pages sent
        self.dest_sent = False
        self.received = 0
        self.metadata_value: PDMetadata | None = None
        self.init_time: float | None = None

    def init(self, dst_page_ids: list[int], metadata_index: int,
             prefix_pages: int = 0, prefix_swa_pages: int = 0) -> None:
        why = self._bad_input(dst_page_ids, metadata_index) or (
            f"prefix_pages {prefix_pages} < 0" if prefix_pages < 0 else None) or (
            f"prefix_swa_pages {prefix_swa_pages} < 0" if prefix_swa_pages < 0 else None)
        if why:
            self.abort(why)
            return
        self.dst, self.metadata_index = list(dst_page_ids), metadata_index
        self.prefix_pages, self.prefix_swa_pages = prefix_pages, prefix_swa_pages
        self.init_time = time.monotonic()
        self.mgr.transition(self, KVPoll.TRANSFERRING)
        self.mgr.call_soon(self.send_destination)

    @property
    def metadata(self) -> PDMetadata | None:
        return self.metadata_value

    def peers(self) -> list[str]:
        return [self.peer, *self.silent] if self.peer is not None else []

    def set_route(self, route) -> None:
        """Under mgr.lock: the look-up's bootstrap_client.PrefillRoute for this room."""
        self.peer, self.fanout, self.silent = route.endpoint, route.fanout, route.silent

    # ---- transfer thread
    def send_join(self) -> None:
        if not is_final(self.state) and self.peer is not None and not self.dest_sent:
            self.mgr.send_to(self.peer, Join(self.room, self.mgr.endpoint, self.fanout))
            for peer in self.silent:
                self.mgr.send_to(peer, Join(self.room, self.mgr.endpoint))

    def send_destination(self) -> None:
        mgr = self.mgr
        if is_final(self.state) or self.peer is None or self.dst is None or self.dest_sent:
            return
        self.dest_sent = True
        mgr.send_to(self.peer, Destination(self.room, mgr.endpoint, self.dst,
                                           self.metadata_index, mgr.geometry,
                                           **mgr.destination_extras(),
                                           prefix_pages=self.prefix_pages,
                                           prefix_swa_pages=self.prefix_swa_pages,
                                           fanout=self.fanout))
        for peer in self.silent:
            mgr.send_to(peer, Destination(self.room, mgr.endpoint, [], self.metadata_index,
                                          mgr.geometry, silent=True))

    def on_chunk(self, msg: Chunk, frames: list) -> None:
        mgr = self.mgr
        if is_final(self.state) or msg.endpoint != self.peer:
            return  # late, or not from the prefill this room resolved to
        if self.dst is None or msg.dst_offset + msg.num_pages > len(self.dst):
            mgr.fail(self, f"prefill sent pages {msg.dst_offset}.."
                           f"{msg.dst_offset + msg.num_pages} beyond the "
                           f"{len(self.dst or [])} reserved")
            return
        try:
            mgr.write_pages(self, msg, frames)
        except Exception as e:  # malformed frames: this room fails, the thread goes on
            mgr.fail(self, f"bad page data from {msg.endpoint}: {type(e).__name__}: {e}")
            return
        with mgr.lock:  # the count stops when the room ends (runner abort: any thread)
            if is_final(self.state):
                return  # landed in pages of a room that ended meanwhile: not counted
            self.received += msg.num_pages
        if msg.last:
            self.metadata_value = msg.metadata
            if self.received != len(self.dst):
                mgr.fail(self, f"prefill sent {self.received} pages, the decode server "
                               f"reserved {len(self.dst)}")
            elif msg.metadata is not None and msg.metadata.room != self.room:
                mgr.fail(self, f"Context corruption detected: metadata of room "
                               f"{msg.metadata.room} arrived for room {self.room}")
            else:
                mgr.transition(self, KVPoll.SUCCESS)
        if msg.ack or msg.last:
            mgr.send_to(self.peer, Ack(self.room, mgr.endpoint, self.received,
                                       self.state == KVPoll.SUCCESS))

    def timed_out(self, now: float) -> str | None:
        # (BOOTSTRAPPING is bounded by the resolver thread, which knows the last error)
        if self.init_time is not None and now - self.init_time > self.mgr.waiting_timeout:
            return (f"no KV from the prefill server within {self.mgr.waiting_timeout:g} s "
                    f"of init (waiting timeout)")
        return None


__all__ = ["Receiver", "Sender", "is_final"]
