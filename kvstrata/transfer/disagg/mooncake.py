"""The `mooncake` backend: Mooncake Transfer Engine (PyPI `mooncake-transfer-engine-non-cuda`,
needs Debian `libibverbs1` to import) over its TCP transport with P2PHANDSHAKE metadata (no
metadata server). Both servers register their page buffers with their engine; the decode
side sends, in its Destination, its engine's session ("host:rpc_port") and the base address
of each buffer; the prefill side then writes the pages straight into the decode server's
memory with `batch_transfer_sync_write` (contiguous runs merged, one entry per (buffer,
run, section)) and reports each send() with a Chunk (no frames) on the zmq control plane
(control.py), the metadata with the last one, exactly as the tcp backend does.

Writes are synchronous on the prefill's transfer thread, in batches of at most
MAX_BATCH_ENTRIES entries (larger batches overflow the TCP transport's per-peer queues
unless MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER / MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER are
raised; machine-facts.md). A failed write fails the room (and tells the decode side).
"""
from __future__ import annotations

from kvstrata.transfer.disagg.control import ZmqDisaggManager
from kvstrata.transfer.disagg.messages import Chunk, Destination, contiguous_runs
from kvstrata.transfer.disagg.rooms import Sender

MAX_BATCH_ENTRIES = 512


def _engine_class():
    try:
        from mooncake.engine import TransferEngine  # noqa: PLC0415
    except ImportError as e:
        raise RuntimeError(
            "--disaggregation-transfer-backend mooncake needs the PyPI package "
            "mooncake-transfer-engine-non-cuda (and Debian libibverbs1): "
            f"{e}") from None
    return TransferEngine


class MooncakeManager(ZmqDisaggManager):
    def _setup_backend(self) -> None:
        self.engine = _engine_class()()
        rc = self.engine.initialize(self.host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({self.host!r}, "
                               f"P2PHANDSHAKE, tcp) returned {rc}")
        self.session = f"{self.host}:{self.engine.get_rpc_port()}"
        self._registered = []
        for b in self.buffers:
            if not b.numel():  # an all-SWA model's full pool: page ids, no bytes to move
                continue
            rc = self.engine.register_memory(b.data_ptr(), b.numel())
            if rc != 0:
                raise RuntimeError(f"Mooncake register_memory of {b.numel()} bytes returned {rc}")
            self._registered.append(b.data_ptr())

    def _close_backend(self) -> None:
        for ptr in self._registered:
            self.engine.unregister_memory(ptr)
        self._registered = []
        # Dropped here, not at some later garbage collection: the engine's destructor blocks
        # the whole process for about 1 s once it has connected to a peer (0.3.13.post1).
        del self.engine

    def destination_extras(self) -> dict:
        return {"mooncake_session": self.session,
                "buffer_ptrs": [b.data_ptr() for b in self.buffers]}

    def _send_pages(self, s: Sender, dest: Destination, src: list[int], dst: list[int],
                    offset: int, last: bool, metadata, region: int = 0) -> None:
        if not dest.mooncake_session or len(dest.buffer_ptrs) != len(self.buffers):
            self.fail(s, "the decode server does not use the mooncake backend (no transfer "
                         "engine session in its destination)")
            return
        src_ptrs, dst_ptrs, lengths = [], [], []
        runs = contiguous_runs(src, dst)
        # this region's buffers only (regions.py): ours, and the decode's with their addresses
        theirs = [(g, ptr) for g, ptr in zip(dest.geometry, dest.buffer_ptrs)
                  if g.region == region]
        for buf, (geom, dst_base) in zip(self.regions.groups[region], theirs):
            sections, src_pages, page_bytes = buf.shape
            src_base = buf.data_ptr()
            for s0, d0, n in runs:
                for sec in range(sections):
                    src_ptrs.append(src_base + (sec * src_pages + s0) * page_bytes)
                    dst_ptrs.append(dst_base + (sec * geom.num_pages + d0) * page_bytes)
                    lengths.append(n * page_bytes)
        for i in range(0, len(lengths), MAX_BATCH_ENTRIES):
            j = i + MAX_BATCH_ENTRIES
            rc = self.engine.batch_transfer_sync_write(dest.mooncake_session, src_ptrs[i:j],
                                                       dst_ptrs[i:j], lengths[i:j])
            if rc != 0:
                self.fail(s, f"Mooncake write to {dest.mooncake_session} failed (rc {rc})")
                return
        self.send_to(dest.endpoint, Chunk(s.room, self.endpoint, offset, len(src), ack=True,
                                        last=last, metadata=metadata if last else None,
                                        region=region))


__all__ = ["MooncakeManager"]
