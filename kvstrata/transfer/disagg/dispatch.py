"""ZmqDisaggManager's message half (control.py runs the transfer thread): each control
message that arrives goes to its room -- or waits for a room not created yet --, and the
prefill side ships a room's pages once its decode peers told it where to. Transfer thread
only. A mixin: it reads the manager's rooms, regions and geometry, and calls its public
`send_to` / `transition` / `fail` and the backend's `_send_pages`.
"""
from __future__ import annotations

import time

from kvstrata.protocol.disagg import KVPoll
from kvstrata.transfer.disagg.messages import (DECODER, Abort, Ack, Chunk, Destination, Join,
                                               Ping, Pong, geometry_mismatch)
from kvstrata.transfer.disagg.regions import drop_held_swa, geometry_bases, split
from kvstrata.transfer.disagg.rooms import Sender, is_final


class ControlDispatch:
    def _handle(self, frames: list) -> None:
        msg = DECODER.decode(frames[0].buffer)
        now = time.monotonic()
        self.liveness.heard_from(msg.endpoint, now)
        if isinstance(msg, Ping):
            self.send_to(msg.endpoint, Pong(self.endpoint))
        elif isinstance(msg, (Join, Destination)):
            s = self.senders.get(msg.room)
            if s is None:
                self._pending.setdefault(msg.room, ([], now))[0].append(msg)
            elif isinstance(msg, Join):
                self._join(s, msg)
            else:
                self._attach(s, msg)
        elif isinstance(msg, Chunk):
            r = self.receivers.get(msg.room)
            if r is not None:
                r.on_chunk(msg, frames[1:])
        elif isinstance(msg, Ack):
            s = self.senders.get(msg.room)
            if s is not None:
                s.confirm(msg.endpoint, msg.pages, final=msg.done)
                if s.closing is not None:
                    self.fail(s, s.closing)  # FAILED once every final count is in
                elif msg.done:
                    s.acked.add(msg.endpoint)
                    if s.all_acked():
                        self.transition(s, KVPoll.SUCCESS)
        elif isinstance(msg, Abort):
            obj = (self.senders if self.role == "prefill" else self.receivers).get(msg.room)
            if obj is None:
                self._pending.setdefault(msg.room, ([], now))[0].append(msg)
            else:
                self._aborted(obj, msg)

    def _aborted(self, obj, msg: Abort) -> None:
        """The peer failed the room. A decode room answers (not `quiet`): its Abort carries
        the pages it wrote, the count a closing prefill room waits for."""
        if isinstance(obj, Sender):
            obj.confirm(msg.endpoint, msg.pages, final=True)
        self.fail(obj, f"aborted by the {self.peer_role} server ({msg.endpoint}): "
                       f"{msg.reason}", quiet=msg.endpoint if isinstance(obj, Sender) else None)

    # ---- prefill side
    def _adopt_pending(self, s: Sender) -> None:
        early, _ = self._pending.pop(s.room, ([], 0.0))
        for msg in early:
            if isinstance(msg, Abort):
                self._aborted(s, msg)
            elif isinstance(msg, Destination):
                self._attach(s, msg)
            else:
                self._join(s, msg)

    def _join(self, s: Sender, msg: Join | Destination) -> bool:
        """A decode peer of this room is known: its silence now fails the room (liveness).
        False if the room already failed here (the peer is told)."""
        if msg.endpoint not in s.joined:
            s.joined.append(msg.endpoint)
        s.fanout = max(s.fanout, msg.fanout)
        if s.state == KVPoll.FAILED or s.closing is not None:  # failed before it showed up
            self.send_to(msg.endpoint, Abort(s.room, self.endpoint,
                                             s.closing or s.reason or "failed"))
            return False
        return True

    def _attach(self, s: Sender, dest: Destination) -> None:
        if not self._join(s, dest):
            return
        s.dests[dest.endpoint] = dest
        reason = geometry_mismatch(self.geometry, dest.geometry) or s.page_count_error()
        if reason:
            self.fail(s, reason)
            return
        if not s.ready:  # more decode ranks to come (rank_map.py)
            return
        self.transition(s, KVPoll.WAITING_FOR_INPUT, only_from=(KVPoll.BOOTSTRAPPING,))
        queued, s.queued = s.queued, []
        for args in queued:
            self.ship(s, *args)

    def ship(self, s: Sender, page_ids: list[int], last: bool, metadata) -> None:
        if is_final(s.state) or s.closing is not None or s.aborted:
            return
        if not s.ready:
            s.queued.append((page_ids, last, metadata))
            return
        if s.dest is None:  # silent: this rank's decode peer pulls from another rank
            if last:
                self.transition(s, KVPoll.SUCCESS)
            return
        # The prompt's first pages the decode holds already are not shipped (they come first),
        # nor, with hybrid SWA memory, the first SWA pages of its last window it holds too.
        skip = min(s.dest.prefix_pages - s.skipped, len(page_ids))
        if skip > 0:
            page_ids = page_ids[skip:]
            s.skipped += skip
        if s.dest.prefix_swa_pages > s.swa_skipped:
            page_ids, dropped = drop_held_swa(page_ids, self.regions.bases,
                                              s.dest.prefix_swa_pages - s.swa_skipped)
            s.swa_skipped += dropped
        if not page_ids and not last:
            return
        total = len(s.dest.page_ids)
        if s.sent + len(page_ids) > total:
            self.fail(s, f"prefill sent {s.sent + len(page_ids)} pages but the decode server "
                         f"reserved {total}")
            return
        dst = s.dest.page_ids[s.sent:s.sent + len(page_ids)]
        for dest in s.receivers:
            if page_ids:  # from now on its count is needed before the room may fail
                s.shipped.add(dest.endpoint)
            try:  # one run of sends per page region (main, SWA, state pages: regions.py)
                runs = split(page_ids, dst, self.regions.bases, geometry_bases(dest.geometry))
            except ValueError as e:
                self.fail(s, f"prefill and decode disagree on the SWA pages: {e}")
                return
            for i, (region, pos, src_local, dst_local) in enumerate(runs):
                final = i == len(runs) - 1
                self._send_pages(s, dest, src_local, dst_local, s.sent + pos, last and final,
                                 metadata if final else None, region)
                if is_final(s.state) or s.closing is not None:  # a failed write
                    return
        s.sent += len(page_ids)
