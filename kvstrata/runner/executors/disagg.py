"""The runner's half of PD: applies the scheduler's PDOps to a DisaggManager's senders and
receivers (one per bootstrap room) and reports their state *changes* as PDEvents, the same
shape as the HiCache executor's finished/failed job ids (protocol/disagg.py has the op
order and the state machines)."""
from __future__ import annotations

import logging

from kvstrata.protocol.disagg import KVPoll, PDEvent, PDOp
from kvstrata.runner.executors.base import IDLE_WAIT_SECONDS, OpExecutor
from kvstrata.runner.executors.tp_merge import MinRoomState
from kvstrata.transfer.disagg.base import DisaggManager

logger = logging.getLogger(__name__)
_FINAL = (KVPoll.FAILED, KVPoll.SUCCESS)


class DisaggExecutor(OpExecutor):
    """PD's executor: PDOps before the forward, PDEvents (state changes) after it."""
    op_types = (PDOp,)
    event_merges = (MinRoomState,)

    def apply_ops(self, ops: list, idle: bool) -> list:
        self.apply(ops)
        return []

    def poll_events(self, idle: bool) -> list:
        events = self.poll()
        if idle and not events and self.has_live:
            self.wait(IDLE_WAIT_SECONDS)  # instead of the engine loop spinning
            events = self.poll()
        return events

    def __init__(self, manager: DisaggManager):
        self.manager = manager
        self._rooms: dict[int, object] = {}        # room -> KVSender | KVReceiver
        self._reported: dict[int, KVPoll] = {}     # room -> state last reported

    def apply(self, ops: list[PDOp]) -> None:
        """In order, before the step's forward. abort/release of an unknown room are no-ops
        (both are idempotent by contract); init/send of an unknown room is a scheduler bug."""
        for op in ops:
            kind = op.kind
            if kind == "sender_create":
                self._add(op.room, self.manager.create_sender(op.bootstrap_host,
                                                              op.bootstrap_port, op.room))
            elif kind == "receiver_create":
                self._add(op.room, self.manager.create_receiver(op.bootstrap_host,
                                                                op.bootstrap_port, op.room))
            elif kind == "sender_init":
                self._get(op).init(op.num_pages, op.metadata_index)
            elif kind == "receiver_init":
                self._get(op).init(list(op.page_ids), op.metadata_index, op.prefix_pages,
                                   op.prefix_swa_pages)
            elif kind == "send":
                self._get(op).send(list(op.page_ids), op.last, op.metadata)
            elif kind == "abort":
                if op.room in self._rooms:
                    # The request ended here (refused, aborted by its client, failed).
                    self._rooms[op.room].abort("the request ended on this server")
            elif kind == "release":
                self._rooms.pop(op.room, None)
                self._reported.pop(op.room, None)
            else:
                raise ValueError(f"unknown PD op kind {kind!r}")

    def poll(self) -> list[PDEvent]:
        """State changes since the last poll (a room's first poll reports its state).
        FAILED carries the reason; a receiver's SUCCESS carries the prefill's metadata;
        both terminal states the room's pages moved (KVSender / KVReceiver.pages_moved)."""
        events = []
        for room, obj in self._rooms.items():
            state = obj.poll()
            if self._reported.get(room) == state:
                continue
            self._reported[room] = state
            event = PDEvent(room, int(state))
            if state in _FINAL:
                event.pages, event.swa_pages = obj.pages_moved, obj.swa_pages_moved
                event.state_pages = obj.state_pages_moved
            if state == KVPoll.FAILED:
                event.error = obj.failure_reason or "PD transfer failed"
            elif state == KVPoll.SUCCESS and hasattr(obj, "metadata"):
                event.metadata = obj.metadata
            events.append(event)
        return events

    @property
    def has_live(self) -> bool:
        """Some room may still change state on its own (a transfer is in flight)."""
        return any(self._reported.get(r) not in _FINAL for r in self._rooms)

    def wait(self, timeout: float) -> None:
        """The idle step's wait: until some room may have changed, at most `timeout` s."""
        self.manager.wait_for_change(timeout)

    def close(self) -> None:
        self.manager.close()
        self._rooms.clear()
        self._reported.clear()

    def _add(self, room: int, obj) -> None:
        if room in self._rooms:
            raise ValueError(f"PD room {room} is already live in the runner (released?)")
        self._rooms[room] = obj

    def _get(self, op: PDOp):
        try:
            return self._rooms[op.room]
        except KeyError:
            raise KeyError(f"PD op {op.kind} for room {op.room}, which the runner does not "
                           f"know (no *_create, or already released)") from None


__all__ = ["DisaggExecutor"]
