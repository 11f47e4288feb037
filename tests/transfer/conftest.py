"""Two transfer managers (prefill + decode) in one process on 127.0.0.1, each over its own
MHA device pool filled with random bytes (the real page-buffer geometry of page_buffers_of)."""
from __future__ import annotations

import platform
import sys
import time

import pytest
import torch

from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv.device_pool import MHATokenToKVPool
from kvstrata.kv.device_pool import page_buffers_of
from kvstrata.transfer.disagg import tcp
from kvstrata.transfer.disagg.registry import create_manager
from tests.helpers.ports import free_port  # noqa: F401 (the transfer tests import it from here)

NUM_PAGES = 48


def wait_until(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def random_pool(dtype: str = "float32", page_size: int = 1, head_dim: int = 8,
                seed: int = 0) -> MHATokenToKVPool:
    plan = KVPlan.mha(num_layers=3, num_kv_heads=2, head_dim=head_dim, dtype=dtype,
                      page_size=page_size, num_pages=NUM_PAGES)
    pool = MHATokenToKVPool(plan, "cpu")
    gen = torch.Generator().manual_seed(seed)
    raw = page_buffers_of(pool)[0]
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return pool


class Pair:
    """A prefill and a decode manager of one backend; `new_prefill()` adds another."""

    def __init__(self, backend: str, dtype: str, page_size: int, decode_head_dim: int = 8,
                 decode_dtype: str | None = None):
        self.backend, self.dtype, self.page_size = backend, dtype, page_size
        self.managers = []
        self.decode_pool = random_pool(decode_dtype or dtype, page_size, decode_head_dim, 1)
        self.decode = self._make("decode", self.decode_pool, 0, decode_dtype or dtype)
        self.new_prefill()

    def _make(self, role, pool, port, dtype):
        mgr = create_manager(self.backend, role, page_buffers_of(pool), host="127.0.0.1",
                             bootstrap_port=port, num_metadata_slots=8,
                             page_size=self.page_size, kv_dtype=dtype)
        self.managers.append(mgr)
        return mgr

    def new_prefill(self, seed: int = 2, port: int | None = None):
        self.prefill_pool = random_pool(self.dtype, self.page_size, seed=seed)
        self.bootstrap_port = port or free_port()
        self.prefill = self._make("prefill", self.prefill_pool, self.bootstrap_port,
                                  self.dtype)
        return self.prefill

    def close(self):
        for mgr in self.managers:
            mgr.close()


# mooncake's wheel exists for cp311 x86_64 Linux only (pyproject's marker); there it is a
# dev dependency and must work: no import-based skip that would hide a broken install.
MOONCAKE_WHEEL = (sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64"
                  and sys.platform == "linux")
BACKENDS = ["tcp-gathered", "tcp-slices",
            pytest.param("mooncake", marks=pytest.mark.skipif(
                not MOONCAKE_WHEEL, reason="no mooncake wheel for this Python/platform"))]


@pytest.fixture
def make_pair(monkeypatch):
    pairs = []

    def make(backend: str = "tcp-gathered", dtype: str = "float32", page_size: int = 1,
             **kw) -> Pair:
        # tcp picks its wire layout by frame size; force each one so both are tested
        if backend.startswith("tcp"):
            monkeypatch.setattr(tcp, "SLICE_MIN_BYTES",
                                0 if backend == "tcp-slices" else 1 << 40)
        pair = Pair(backend.split("-")[0], dtype, page_size, **kw)
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.close()
