"""The `fake` backend: moves nothing (SGLang's fake/conn.py). Used for warm-up requests
(bootstrap_host == FAKE_BOOTSTRAP_HOST) and by tests of the scheduler side.

States (chosen to fit the op order of protocol/disagg.py, so a scheduler drives a fake
request exactly like a real one):
  sender:   WAITING_FOR_INPUT from creation (there is no decode side to wait for);
            send(last=False) -> TRANSFERRING; send(last=True) -> SUCCESS; abort -> FAILED.
  receiver: WAITING_FOR_INPUT from creation (no prefill endpoint to resolve);
            init() -> SUCCESS with `metadata` None (no first token arrives: the caller must
            treat a fake transfer's output as meaningless, as SGLang's warm-up does);
            abort -> FAILED.
"""
from __future__ import annotations

from kvstrata.protocol.disagg import KVPoll, PDMetadata
from kvstrata.transfer.disagg.base import DisaggManager, KVReceiver, KVSender


class _FakeRoom:
    def __init__(self) -> None:
        self._state = KVPoll.WAITING_FOR_INPUT
        self._reason: str | None = None

    def poll(self) -> KVPoll:
        return self._state

    def abort(self, reason: str = "aborted") -> None:
        if self._state != KVPoll.SUCCESS:
            self._state, self._reason = KVPoll.FAILED, reason

    @property
    def failure_reason(self) -> str | None:
        return self._reason


class FakeSender(_FakeRoom, KVSender):
    def init(self, num_pages: int, metadata_index: int) -> None:
        pass

    def send(self, page_ids: list[int], last: bool, metadata: PDMetadata | None = None) -> None:
        if self._state != KVPoll.FAILED:
            self._state = KVPoll.SUCCESS if last else KVPoll.TRANSFERRING


class FakeReceiver(_FakeRoom, KVReceiver):
    def init(self, dst_page_ids: list[int], metadata_index: int,
             prefix_pages: int = 0, prefix_swa_pages: int = 0) -> None:
        if self._state != KVPoll.FAILED:
            self._state = KVPoll.SUCCESS

    @property
    def metadata(self) -> PDMetadata | None:
        return None


class FakeManager(DisaggManager):
    def __init__(self, role: str = "prefill"):
        self.role = role

    def create_sender(self, bootstrap_host: str, bootstrap_port: int, room: int) -> KVSender:
        return FakeSender()

    def create_receiver(self, bootstrap_host: str, bootstrap_port: int,
                        room: int) -> KVReceiver:
        return FakeReceiver()

    def wait_for_change(self, timeout: float) -> None:
        return None  # fake states change only inside the caller's own calls

    def close(self) -> None:
        pass


__all__ = ["FakeManager", "FakeReceiver", "FakeSender"]
