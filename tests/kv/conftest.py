"""Fixtures of the storage tests: a `mooncake_master` of their own on 127.0.0.1 (stopped by
pid when the module's tests end). Mooncake tests are skipped only when the client cannot be
imported (its wheel exists for CPython 3.11 x86_64 Linux only), and the reason is shown."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def mooncake_master():
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        pytest.skip(f"mooncake client not importable: {e}")
    from kvstrata.kv.storage.mooncake_master import MooncakeMaster
    master = MooncakeMaster()
    master.start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def mooncake_extra(mooncake_master):
    """Extra config of a small Mooncake client of that master (64 MiB contributed)."""
    return {"master_server_address": mooncake_master.address, "protocol": "tcp",
            "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1",
            "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20}
