"""The `tcp` backend (the embedded default): page bytes travel on the same zmq PUSH/PULL
connection as the control messages (control.py), as extra frames after a Chunk header.

Sender (prefill transfer thread): one send() becomes messages of about MESSAGE_BYTES each
(measured on this box: several pages per message is what lets zmq reach ~1 GB/s). In a
message, pages that are contiguous in both source and destination are merged into runs;
  "slices":   runs are long enough -> one zero-copy frame per (buffer, run, section), each
              a view of the pool's memory (no copy on the sender);
  "gathered": short runs (page_size 1 pools) -> one frame per buffer, the pages gathered
              into [sections, n, page_bytes] (one copy beats thousands of tiny frames).
Receiver (decode transfer thread): copies each frame straight into the destination pages of
the registered buffer (numpy views of the same memory as the torch uint8 view).
Zero-copy frames are safe because the scheduler keeps the source pages locked until the
sender reports SUCCESS or FAILED.
"""
from __future__ import annotations

import numpy as np

from kvstrata.transfer.disagg.control import ZmqDisaggManager
from kvstrata.transfer.disagg.messages import Chunk, Destination, contiguous_runs
from kvstrata.transfer.disagg.rooms import Receiver, Sender

MESSAGE_BYTES = 4 << 20     # page bytes per zmq message
SLICE_MIN_BYTES = 32 << 10  # mean frame size from which zero-copy slices beat gathering


def _wide(array: np.ndarray) -> np.ndarray:
    """The same memory with 8-byte elements when rows allow it (numpy and torch move uint8
    rows through slow paths: 1.3-2.2 GB/s vs 11-14 on wider elements, machine-facts.md)."""
    return array.view(np.uint64) if array.shape[-1] % 8 == 0 else array


class TcpManager(ZmqDisaggManager):
    def _setup_backend(self) -> None:
        # per page region (regions.py): [S, P, B] uint8 numpy views of the pools' memory
        self._region_arrays = [[b.numpy() for b in g] for g in self.regions.groups]
        self._region_wide = [[_wide(a) for a in g] for g in self._region_arrays]

    # ---- prefill
    def _send_pages(self, s: Sender, dest: Destination, src: list[int], dst: list[int],
                    offset: int, last: bool, metadata, region: int = 0) -> None:
        page_bytes = self.regions.page_bytes(region)
        step = max(1, MESSAGE_BYTES // max(1, page_bytes))
        starts = list(range(0, len(src), step)) or [0]  # an empty last send still reports
        for start in starts:
            final = start == starts[-1]
            sub_src, sub_dst = src[start:start + step], dst[start:start + step]
            layout, runs, frames = self._pack(sub_src, sub_dst, region, page_bytes)
            self.send_to(dest.endpoint, Chunk(
                s.room, self.endpoint, offset + start, len(sub_src), layout, runs,
                ack=final, last=last and final, metadata=metadata if last and final else None,
                region=region), frames)

    def _pack(self, src: list[int], dst: list[int], region: int,
              page_bytes: int) -> tuple[str, list, list]:
        if not src:
            return "none", [], []
        runs = contiguous_runs(src, dst)
        arrays = self._region_arrays[region]
        sections = sum(a.shape[0] for a in arrays)
        if len(src) * page_bytes >= SLICE_MIN_BYTES * len(runs) * sections:
            frames = [a[sec, s0:s0 + n] for a in arrays for s0, _, n in runs
                      for sec in range(a.shape[0])]
            # runs as (position in this message, length): the receiver maps positions to
            # its own page ids, so a peer can only ever write pages reserved for the room.
            positions, pos = [], 0
            for _, _, n in runs:
                positions.append((pos, n))
                pos += n
            return "slices", positions, frames
        idx = np.asarray(src, dtype=np.int64)
        return "gathered", [], [np.take(w, idx, axis=1) for w in self._region_wide[region]]

    # ---- decode
    def write_pages(self, r: Receiver, msg: Chunk, frames: list) -> None:
        if not 0 <= msg.region < len(self._region_arrays):
            raise ValueError(f"page region {msg.region}: this server registered "
                             f"{len(self._region_arrays)}")
        arrays, wide = self._region_arrays[msg.region], self._region_wide[msg.region]
        base = self.regions.bases[msg.region]
        dst = [d - base for d in r.dst[msg.dst_offset:msg.dst_offset + msg.num_pages]]
        if not all(0 < d < self.regions.pages[msg.region] for d in dst):
            raise ValueError(f"pages of region {msg.region} sent to reserved pages of another")
        if msg.layout == "gathered":
            if len(frames) != len(wide):
                raise ValueError(f"{len(frames)} frames for {len(wide)} buffers")
            idx = np.asarray(dst, dtype=np.int64)
            for w, frame in zip(wide, frames):
                w[:, idx] = np.frombuffer(frame.buffer, dtype=w.dtype).reshape(
                    w.shape[0], len(dst), w.shape[2])
        elif msg.layout == "slices":
            expected = len(msg.runs) * sum(a.shape[0] for a in arrays)
            if len(frames) != expected:
                raise ValueError(f"{len(frames)} frames, expected {expected}")
            it = iter(frames)
            for a in arrays:
                for pos, n in msg.runs:
                    d0 = dst[pos]
                    if dst[pos:pos + n] != list(range(d0, d0 + n)):
                        raise ValueError(f"run at {pos} is not contiguous in the destination")
                    for sec in range(a.shape[0]):
                        a[sec, d0:d0 + n] = np.frombuffer(next(it).buffer, np.uint8).reshape(
                            n, a.shape[2])
        elif frames:
            raise ValueError(f"layout {msg.layout!r} with {len(frames)} frames")



__all__ = ["TcpManager"]
