"""The runner's half of decode retraction for the torch-free PD pair (pd_fake.py).

Decode retraction's BackupOps are applied first in a step by this fake backup store:
cpu_tensor copies a request's pages into a per-rid store, host_pool into the fake host pool
at the scheduler's host pages; the device pages are wiped at once (they are free from then
on), so a restore into the wrong pages, or from the wrong backup, changes the tokens.
"""
from __future__ import annotations

from tests.unit.fake_runner import FakeRunner, copy_pages


class FakeBackupStore:
    """The runner's half of decode retraction, on the fake KV pool (slot -> (pos, token))."""

    def __init__(self, runner: FakeRunner):
        self.runner = runner
        self.cpu: dict[str, tuple[int, dict]] = {}  # rid -> (num pages, slot offset -> value)
        self.host_held: dict[str, list[int]] = {}  # rid -> host pages (host_pool)
        self.log: list[tuple[str, str, str]] = []  # (kind, rid, backend)
        # Pages the decode radix tree still caches: a retraction unlocks a request's cached
        # prefix but does not free it, so those pages keep their KV.
        self.cached_pages = lambda: set()

    def apply(self, op) -> None:
        r, P = self.runner, self.runner.page_size
        self.log.append((op.kind, op.rid, op.backend))
        assert op.backend in ("cpu_tensor", "host_pool"), op
        if op.kind == "backup":
            assert op.rid not in self.cpu and op.rid not in self.host_held, f"two backups {op}"
            assert len(op.device_pages) == -(-op.num_tokens // P) and 0 not in op.device_pages
            if op.backend == "cpu_tensor":
                assert not op.host_pages
                saved = {i * P + off: r.kv[p * P + off] for i, p in enumerate(op.device_pages)
                         for off in range(P) if p * P + off in r.kv}
                self.cpu[op.rid] = (len(op.device_pages), saved)
            else:
                assert len(op.host_pages) == len(op.device_pages) and 0 not in op.host_pages
                held = {p for pages in self.host_held.values() for p in pages}
                assert not held & set(op.host_pages), f"host pages of a live backup: {op}"
                copy_pages(r.kv, r.host, op.device_pages, op.host_pages, P)
                self.host_held[op.rid] = list(op.host_pages)
            cached = self.cached_pages()
            for p in op.device_pages:  # free from now on: nothing may read them back
                if p in cached:
                    continue
                for off in range(P):
                    r.kv.pop(p * P + off, None)
        elif op.kind == "restore":
            if op.backend == "cpu_tensor":
                n, saved = self.cpu.pop(op.rid)
                assert n == len(op.device_pages), (op, n)
                for i, p in enumerate(op.device_pages):
                    for off in range(P):
                        if i * P + off in saved:
                            r.kv[p * P + off] = saved[i * P + off]
            else:
                assert self.host_held.pop(op.rid) == list(op.host_pages), op
                copy_pages(r.host, r.kv, op.host_pages, op.device_pages, P)
        elif op.kind == "discard":
            self.cpu.pop(op.rid, None)  # idempotent
            self.host_held.pop(op.rid, None)
        else:
            raise AssertionError(f"unknown backup op {op}")

    def count(self, kind: str, backend: str | None = None) -> int:
        return sum(1 for k, _, b in self.log if k == kind and backend in (None, b))
