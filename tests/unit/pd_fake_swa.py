"""The torch-free PD pair (pd_fake.py) with hybrid SWA memory: both runners keep a fake SWA
pool (fake_swa_runner.py, which checks every window read against the full pool), the hub
moves a room's SWA pages (wire ids from the full pool's page count on, cache/swa_pd.py) from
the prefill's SWA pool into the decode's, and the backup store keeps BackupOp.swa_pages."""
from __future__ import annotations

from kvstrata.cache.swa_pd import swa_base
from tests.unit.fake_runner import copy_pages
from tests.unit.fake_swa_runner import FakeSWARunner
from tests.unit.pd_fake import FakeTransferHub, PDFakeRunner, PDPair
from tests.unit.pd_fake_backup import FakeBackupStore
from tests.unit.pd_fake_regions import split_at_base


class SWAHub(FakeTransferHub):
    def __init__(self, page_size: int, delay: int = 0):
        super().__init__(page_size, delay)
        self.swa_pages_per_room: dict[int, int] = {}  # SWA pages that crossed, per copy
        self.swa_pages_moved = 0

    def _wanted(self, link) -> list[int]:
        """Past the held prefix, less the first SWA pages the decode holds too."""
        base, held = swa_base(self.runners["prefill"].num_full_pages), link.prefix_swa_pages
        out = []
        for s in super()._wanted(link):
            if s >= base and held:
                held -= 1
            else:
                out.append(s)
        return out

    def _copy(self, src_pages: list[int], dst_pages: list[int]) -> int:
        pre, dec = self.runners["prefill"], self.runners["decode"]
        full, swa = split_at_base(src_pages, dst_pages, swa_base(pre.num_full_pages),
                                  swa_base(dec.num_full_pages))
        copy_pages(pre.kv, dec.kv, [s for s, _ in full], [d for _, d in full], self.page_size)
        copy_pages(pre.swa_kv, dec.swa_kv, [s for s, _ in swa], [d for _, d in swa],
                   self.page_size)
        self.moved_pages += len(src_pages)
        self.swa_pages_moved += len(swa)
        return len(swa)


class SWABackupStore(FakeBackupStore):
    """Backups of the live window's SWA pages beside the full pages: cpu_tensor in a per-rid
    store, host_pool in the runner's host SWA half under the host ids of their full pages
    (the last len(swa_pages) host pages); the device SWA pages are wiped at once."""

    def __init__(self, runner):
        super().__init__(runner)
        self.swa_cpu: dict[str, list[dict]] = {}
        self.swa_backed_up = {"cpu_tensor": 0, "host_pool": 0}

    def apply(self, op) -> None:
        r, P = self.runner, self.runner.page_size
        host = op.host_pages[len(op.host_pages) - len(op.swa_pages):]
        if op.kind == "backup" and op.swa_pages:
            assert 0 not in op.swa_pages, op
            if op.backend == "cpu_tensor":
                self.swa_cpu[op.rid] = [{o: r.swa_kv.get(p * P + o) for o in range(P)}
                                        for p in op.swa_pages]
            else:
                copy_pages(r.swa_kv, r.swa_host, op.swa_pages, host, P)
            self.swa_backed_up[op.backend] += len(op.swa_pages)
            for p in op.swa_pages:  # free from now on
                for o in range(P):
                    r.swa_kv.pop(p * P + o, None)
        elif op.kind == "restore" and op.backend == "host_pool":
            assert len(host) == len(op.swa_pages), op
            copy_pages(r.swa_host, r.swa_kv, host, op.swa_pages, P)
        elif op.kind == "restore" and (op.swa_pages or op.rid in self.swa_cpu):
            saved = self.swa_cpu.pop(op.rid)
            assert len(saved) == len(op.swa_pages), (op, len(saved))
            for p, page in zip(op.swa_pages, saved):
                for o, value in page.items():
                    if value is not None:
                        r.swa_kv[p * P + o] = value
        elif op.kind == "discard":
            self.swa_cpu.pop(op.rid, None)
        super().apply(op)


class PDSWAFakeRunner(PDFakeRunner, FakeSWARunner):
    def __init__(self, hub, side, num_full_pages: int, **kw):
        super().__init__(hub, side, **kw)
        self.num_full_pages = num_full_pages
        self.backups = SWABackupStore(self)


def swa_pair(page_size, window, prefill_pages, decode_pages, prefill_swa, decode_swa,
             prefill_cfg=None, decode_cfg=None, **kw) -> PDPair:
    pair = PDPair(page_size, prefill_pages, decode_pages, hub_cls=SWAHub,
                  runner_cls=_Runner, runner_kw={"window": window},
                  prefill_cfg={"num_swa_pages": prefill_swa, "swa_window": window,
                               **(prefill_cfg or {})},
                  decode_cfg={"num_swa_pages": decode_swa, "swa_window": window,
                              **(decode_cfg or {})}, **kw)
    pair.prefill_runner.num_full_pages = prefill_pages
    pair.decode_runner.num_full_pages = decode_pages
    return pair


class _Runner(PDSWAFakeRunner):
    """Built by PDPair before the page counts are known: swa_pair sets them after."""

    def __init__(self, hub, side, **kw):
        super().__init__(hub, side, 0, **kw)
