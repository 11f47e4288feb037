"""The CPU KV pool asks for transparent huge pages before its first write (kv/huge_pages.py)
and is zeroed either way; the ablation and small tensors skip the request."""
from __future__ import annotations

import sys

import pytest
import torch

from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv import huge_pages
from kvstrata.kv.device_pool import MHATokenToKVPool


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            return fh.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


def test_pool_is_zeroed_and_advised(monkeypatch):
    monkeypatch.setenv("KVSTRATA_CPU_HUGE_PAGES", "1")  # the default (tests/conftest.py: 0)
    calls = []
    real = huge_pages.advise_huge_pages
    monkeypatch.setattr(huge_pages, "advise_huge_pages", lambda t: calls.append(t) or real(t))
    plan = KVPlan.mha(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                      page_size=16, num_pages=2048, num_rows=4, context_len=64)
    pool = MHATokenToKVPool(plan, "cpu")
    assert len(calls) == 1 and calls[0].data_ptr() == pool.kv.data_ptr()
    assert pool.kv.abs().sum().item() == 0  # finite zeros, as torch.zeros gave
    if sys.platform.startswith("linux") and _thp_mode() in ("madvise", "always"):
        assert real(torch.empty(8 << 20, dtype=torch.uint8))  # the kernel takes the advice


def test_ablation_and_small_tensors_skip(monkeypatch):
    assert not huge_pages.advise_huge_pages(torch.empty(1024))  # under two huge pages
    monkeypatch.setenv("KVSTRATA_CPU_HUGE_PAGES", "0")
    assert not huge_pages.advise_huge_pages(torch.empty(8 << 20, dtype=torch.uint8))
    t = huge_pages.empty_cpu_pool((3, 5), torch.float32)
    assert t.shape == (3, 5) and torch.equal(t, torch.zeros(3, 5))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_advice_covers_only_whole_aligned_huge_pages(monkeypatch):
    seen = {}

    class FakeLibc:
        def madvise(self, start, length, advice):
            seen.update(start=start.value, length=length.value, advice=advice)
            return 0

    monkeypatch.setenv("KVSTRATA_CPU_HUGE_PAGES", "1")
    monkeypatch.setattr(huge_pages.ctypes, "CDLL", lambda *a, **k: FakeLibc())
    t = torch.empty(7 << 20, dtype=torch.uint8)
    assert huge_pages.advise_huge_pages(t)
    hp = huge_pages.HUGE_PAGE
    assert seen["advice"] == huge_pages.MADV_HUGEPAGE and seen["start"] % hp == 0
    assert seen["length"] % hp == 0 and seen["length"] > 0
    assert t.data_ptr() <= seen["start"]
    assert seen["start"] + seen["length"] <= t.data_ptr() + t.numel()
