"""The interface every PD transfer backend implements (tcp, mooncake, fake).

A `DisaggManager` per server owns the sockets/threads, registers the KV page buffers and
the metadata slots, and (prefill side) runs the bootstrap server. Per request the prefill
side has a `KVSender`, the decode side a `KVReceiver`; both are polled (non-blocking) by the
runner's executor, which turns state changes into `PDEvent`s for the scheduler.

Page buffers: each registered buffer is a contiguous uint8 tensor viewed as
[sections, pages, page_bytes]; page p of the buffer is `buf[:, p, :]` (for the MHA pool:
sections = 2 * num_layers (K and V of every layer), page_bytes = page_size * heads * dim *
itemsize). Both sides must register the same number of buffers with the same sections and
page_bytes (checked at the handshake: a mismatch fails the request with a clear error);
the number of pages may differ. Page ids are the pool's page ids (page 0 is the padding
page and is never sent).

Metadata slots: `num_metadata_slots` per manager, indexed by `metadata_index`; a request
holds one from sender/receiver init until release, which bounds the transfers in flight.
"""
from __future__ import annotations

import abc

from kvstrata.protocol.disagg import KVPoll, PDMetadata


class MovedPages:
    """A room's page counts, by region (a backend that counts overrides them). The decode
    side counts the pages written into its reserved pages while the room was live (pages
    landing after it ended do not count), final once poll() is SUCCESS or FAILED; the
    prefill side reports the decode's count, which the decode confirms, and once the room
    ended the two must be equal. Pages the decode held already never cross."""

    @property
    def pages_moved(self) -> int:
        return 0

    @property
    def swa_pages_moved(self) -> int:
        """Of `pages_moved`, the SWA region's pages (hybrid SWA memory)."""
        return 0

    @property
    def state_pages_moved(self) -> int:
        """Of `pages_moved`, the state region's (recurrent state: a state slot)."""
        return 0


class KVSender(MovedPages, abc.ABC):
    """Prefill side, one per request (room)."""

    @abc.abstractmethod
    def init(self, num_pages: int, metadata_index: int) -> None:
        """Called once the decode side's destination is known (poll() == WAITING_FOR_INPUT):
        the whole prompt will send `num_pages` pages."""

    @abc.abstractmethod
    def send(self, page_ids: list[int], last: bool, metadata: PDMetadata | None = None) -> None:
        """Queue these source pages (the next ones in prompt order; non-blocking). With
        `last`, `metadata` goes too, after every page. Then poll() reports TRANSFERRING, and
        SUCCESS once the decode side has acknowledged everything. Pages the decode side
        said it holds already (its `prefix_pages`) are passed here like the others and
        skipped by the backend: the prefill's scheduler needs no case for them."""

    @abc.abstractmethod
    def poll(self) -> KVPoll: ...

    @abc.abstractmethod
    def abort(self, reason: str = "aborted") -> None:
        """Idempotent; tells the peer when it can, so its side fails too. Once pages were
        shipped, poll() may stay TRANSFERRING a while after (the decode's count, and its
        reading of the pages, are awaited) before it reports FAILED."""

    @property
    @abc.abstractmethod
    def failure_reason(self) -> str | None: ...


class KVReceiver(MovedPages, abc.ABC):
    """Decode side, one per request (room)."""

    @abc.abstractmethod
    def init(self, dst_page_ids: list[int], metadata_index: int,
             prefix_pages: int = 0, prefix_swa_pages: int = 0) -> None:
        """Send the reserved destination pages (prompt order) to the prefill side; the
        bytes will be written straight into them. `prefix_pages`: the prompt's first pages
        this side already holds (a decode radix cache hit); the destination pages are for
        the pages after them, and the prefill sends only those (a whole-prompt hit moves
        nothing but the metadata). `prefix_swa_pages` (hybrid SWA memory): of the SWA pages
        the prefill sends (the prompt's last window), the first ones, which lie in that
        prefix and are held here too: skipped alike."""

    @abc.abstractmethod
    def poll(self) -> KVPoll: ...

    @property
    @abc.abstractmethod
    def metadata(self) -> PDMetadata | None:
        """What the prefill side sent with its last chunk (set when poll() == SUCCESS)."""

    @abc.abstractmethod
    def abort(self, reason: str = "aborted") -> None: ...

    @property
    @abc.abstractmethod
    def failure_reason(self) -> str | None: ...


class DisaggManager(abc.ABC):
    """One per server. `role` is "prefill" or "decode"."""

    role: str

    @abc.abstractmethod
    def create_sender(self, bootstrap_host: str, bootstrap_port: int, room: int) -> KVSender: ...

    @abc.abstractmethod
    def create_receiver(self, bootstrap_host: str, bootstrap_port: int, room: int) -> KVReceiver: ...

    def wait_for_change(self, timeout: float) -> None:
        """Block until some sender/receiver may have changed state, or `timeout` seconds
        (the runner's idle wait, instead of spinning). Default: sleep."""
        import time  # noqa: PLC0415

        time.sleep(timeout)

    @abc.abstractmethod
    def close(self) -> None:
        """Stop threads/sockets (and the bootstrap server); pending transfers fail."""


__all__ = ["DisaggManager", "KVPoll", "KVReceiver", "KVSender", "PDMetadata"]
