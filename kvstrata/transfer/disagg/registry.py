"""Building a server's DisaggManager from --disaggregation-transfer-backend.

Whatever the backend, a request whose bootstrap_host is FAKE_BOOTSTRAP_HOST (SGLang's
warm-up requests) gets a fake sender/receiver that moves nothing (fake.py).
"""
from __future__ import annotations

from kvstrata.protocol.disagg import FAKE_BOOTSTRAP_HOST
from kvstrata.transfer.disagg.base import DisaggManager, KVReceiver, KVSender
from kvstrata.transfer.disagg.fake import FakeManager

BACKENDS = ("tcp", "mooncake", "fake")


class WarmupRouting(DisaggManager):
    """Sends FAKE_BOOTSTRAP_HOST requests to a FakeManager, the rest to the real one."""

    def __init__(self, real: DisaggManager):
        self.real, self.fake, self.role = real, FakeManager(real.role), real.role

    def create_sender(self, bootstrap_host: str, bootstrap_port: int, room: int) -> KVSender:
        mgr = self.fake if bootstrap_host == FAKE_BOOTSTRAP_HOST else self.real
        return mgr.create_sender(bootstrap_host, bootstrap_port, room)

    def create_receiver(self, bootstrap_host: str, bootstrap_port: int,
                        room: int) -> KVReceiver:
        mgr = self.fake if bootstrap_host == FAKE_BOOTSTRAP_HOST else self.real
        return mgr.create_receiver(bootstrap_host, bootstrap_port, room)

    def wait_for_change(self, timeout: float) -> None:
        self.real.wait_for_change(timeout)

    def close(self) -> None:
        self.real.close()

    def __getattr__(self, name):  # endpoint, senders, ... of the real manager (tests, logs)
        if name == "real":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.real, name)


def create_manager(backend: str, role: str, buffers, *, host: str, bootstrap_port: int,
                   num_metadata_slots: int, page_size: int, kv_dtype: str, tp_rank: int = 0,
                   tp_size: int = 1, kv_replicated: bool = False,
                   swa_buffers=(), state_buffers=()) -> DisaggManager:
    """`buffers`: the page buffers (contiguous uint8 [sections, pages, page_bytes]; see
    base.py). The prefill role starts the bootstrap server on host:bootstrap_port; the
    decode role ignores bootstrap_port (each request names its prefill's). `kv_replicated`:
    every tensor-parallel rank holds the whole KV (MLA), so a decode server of another
    --tp-size can pull from this one (rank_map.py). `swa_buffers`: the SWA pool's page
    buffers (hybrid SWA memory), registered as a second page region, `state_buffers` the
    state pool's (recurrent state: a page per state slot) as a third (regions.py)."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be prefill or decode, got {role!r}")
    if backend == "fake":
        return FakeManager(role)
    if backend == "tcp":
        from kvstrata.transfer.disagg.tcp import TcpManager as cls  # noqa: PLC0415
    elif backend == "mooncake":
        from kvstrata.transfer.disagg.mooncake import MooncakeManager as cls  # noqa: PLC0415
    else:
        raise ValueError(f"unknown disaggregation transfer backend {backend!r} "
                         f"(choices: {', '.join(BACKENDS)})")
    return WarmupRouting(cls(role, buffers, host=host, bootstrap_port=bootstrap_port,
                             num_metadata_slots=num_metadata_slots, page_size=page_size,
                             kv_dtype=kv_dtype, tp_rank=tp_rank, tp_size=tp_size,
                             kv_replicated=kv_replicated, swa_buffers=swa_buffers,
                             state_buffers=state_buffers))


__all__ = ["BACKENDS", "WarmupRouting", "create_manager"]
