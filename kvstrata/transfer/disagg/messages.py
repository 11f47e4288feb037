"""Control messages between a prefill and a decode server's transfer threads (tcp and
mooncake backends), msgspec-encoded (never pickle), one tagged union so one decoder reads
them all. Each message names its sender's endpoint: PULL sockets do not know who wrote.

  decode  -> prefill  Join         the decode server has this room (sent as soon as it knows
                                   the prefill's endpoint, before its pages are reserved):
                                   from then on the prefill watches that peer's liveness
  decode  -> prefill  Destination  the room's reserved pages, metadata slot, buffer geometry
                                   (and, for mooncake, where those buffers live); `silent`:
                                   nothing is wanted from this prefill rank (rank_map.py)
                      Ping         heartbeat (answered by Pong)
  prefill -> decode   Chunk        the next `num_pages` pages of the room; tcp: their bytes
                                   follow as extra frames; mooncake: already written
  decode  -> prefill  Ack          after a chunk marked `ack` (the last of one send())
  either              Abort        the room failed on this side; the peer fails it too

Pages moved (what both servers' disagg_kv_bytes_*_total count): the pages the decode side
wrote into the room's reserved pages while the room was live there (tcp: from the frames;
mooncake: the prefill's one-sided writes a Chunk announced). The decode's Ack and Abort carry
that count (final in Ack.done and in every decode Abort: a decode room counts nothing more
once it ended), and the prefill reports the count the decode confirmed: a prefill room that
fails after shipping pages waits for the decode's final count (its Abort is answered).
"""
from __future__ import annotations

import msgspec

from kvstrata.protocol.disagg import PDMetadata


class BufferGeometry(msgspec.Struct, array_like=True, frozen=True):
    """One registered buffer viewed as [sections, pages, page_bytes] (base.py)."""
    sections: int
    num_pages: int
    page_bytes: int
    region: int = 0                   # 1: the SWA pool's, 2: the state pool's (regions.py)


class Join(msgspec.Struct, tag="join"):
    room: int
    endpoint: str
    fanout: int = 1                   # decode ranks this prefill rank serves (rank_map.py)


class Destination(msgspec.Struct, tag="dest"):
    room: int
    endpoint: str
    page_ids: list[int]
    metadata_index: int
    geometry: list[BufferGeometry]
    mooncake_session: str = ""        # "host:rpc_port" of the decode's transfer engine
    buffer_ptrs: list[int] = []       # base address of each registered buffer
    prefix_pages: int = 0             # the prompt's first pages the decode holds already
    prefix_swa_pages: int = 0         # ... and of the SWA pages sent, the first ones
    fanout: int = 1                   # decode ranks this prefill rank serves (rank_map.py)
    silent: bool = False              # no pages wanted from this prefill rank


class Chunk(msgspec.Struct, tag="chunk"):
    room: int
    endpoint: str
    dst_offset: int                   # index into Destination.page_ids of the first page
    num_pages: int
    # How the frames after the header hold the bytes (tcp): "slices" = one frame per
    # (buffer, run, section) for `runs` of (first destination position, length);
    # "gathered" = one frame per buffer shaped [sections, num_pages, page_bytes];
    # "none" = no frames (mooncake wrote the pages already).
    layout: str = "none"
    runs: list[tuple[int, int]] = []
    ack: bool = False
    last: bool = False
    metadata: PDMetadata | None = None
    region: int = 0                   # whose buffers the pages are in (regions.py)


class Ack(msgspec.Struct, tag="ack"):
    room: int
    endpoint: str
    pages: int                        # pages written into the room's pages so far
    done: bool                        # every page and the metadata arrived (pages final)


class Abort(msgspec.Struct, tag="abort"):
    room: int
    endpoint: str
    reason: str
    pages: int = 0                    # decode -> prefill: the pages it wrote, final


class Ping(msgspec.Struct, tag="ping"):
    endpoint: str


class Pong(msgspec.Struct, tag="pong"):
    endpoint: str


Message = Join | Destination | Chunk | Ack | Abort | Ping | Pong
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(Message)


def check_page_buffers(buffers: list) -> list:
    """Registered buffers must be what base.py says: contiguous uint8 CPU tensors of rank 3
    (both data planes address host memory: numpy views for tcp, raw pointers for mooncake),
    all with the same number of pages (page ids index every buffer)."""
    import torch  # noqa: PLC0415

    for t in buffers:
        if t.dtype != torch.uint8 or t.dim() != 3 or not t.is_contiguous() or \
                t.device.type != "cpu":
            raise ValueError(f"page buffers must be contiguous uint8 CPU tensors "
                             f"[sections, pages, page_bytes], got {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")
    if not buffers or len({int(t.shape[1]) for t in buffers}) != 1:
        raise ValueError("need at least one page buffer, all with the same number of pages")
    return buffers


def geometry_of(buffers) -> list[BufferGeometry]:
    return [BufferGeometry(int(b.shape[0]), int(b.shape[1]), int(b.shape[2])) for b in buffers]


def geometry_mismatch(mine: list[BufferGeometry], theirs: list[BufferGeometry]) -> str | None:
    """Why the two sides cannot exchange pages, or None. Page counts may differ."""
    ours = [(g.sections, g.page_bytes) for g in mine]
    peer = [(g.sections, g.page_bytes) for g in theirs]
    if ours == peer and [g.region for g in mine] == [g.region for g in theirs]:
        return None
    why = "same model, dtype and page size needed on both servers"
    # regions.py: 1 = the SWA pool's buffers, 2 = the state pool's
    state = [any(g.region == 2 for g in side) for side in (mine, theirs)]
    if state[0] != state[1]:
        return (f"KV geometry mismatch: only the {'prefill' if state[0] else 'decode'} server "
                f"keeps recurrent (SSM) state; both must serve the same model (prefill "
                f"buffers (sections, page_bytes) {ours} vs decode {peer})")
    if state[0] and [(g.sections, g.page_bytes) for g in mine if g.region == 2] != [
            (g.sections, g.page_bytes) for g in theirs if g.region == 2]:
        why += "; the state slots differ: start both with the same --mamba-ssm-dtype"
    swa = [any(g.region == 1 for g in side) for side in (mine, theirs)]
    if swa[0] != swa[1]:  # a hybrid SWA server and a uniform one
        return (f"KV geometry mismatch: the {'prefill' if swa[0] else 'decode'} server keeps "
                f"the sliding-window layers in an SWA pool (hybrid SWA memory), the other "
                f"one pool for every layer; start both with the same "
                f"--disable-hybrid-swa-memory (prefill buffers (sections, page_bytes) "
                f"{ours} vs decode {peer})")
    if len(ours) != len(peer):  # runner/spec/handoff.py: an EAGLE draft's KV is a buffer
        why += ("; an EAGLE / NEXTN draft's KV travels as a second buffer, so both servers "
                "need the same --speculative-algorithm and draft (chains, --speculative-"
                "eagle-topk 1)")
    return (f"KV geometry mismatch: prefill buffers (sections, page_bytes) {ours} vs decode "
            f"{peer} ({why})")


def contiguous_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both page lists advance by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


__all__ = ["Abort", "Ack", "BufferGeometry", "Chunk", "DECODER", "Destination", "ENCODER",
           "Join", "Message", "Ping", "Pong", "check_page_buffers", "contiguous_runs",
           "geometry_mismatch", "geometry_of"]
