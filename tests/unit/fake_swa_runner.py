"""The fake runner with a hybrid SWA pool: checks what ScheduledRequest.swa_slots promise.

Besides the fake full pool (FakeRunner), it keeps a fake SWA pool (SWA slot -> (position,
token)) and an SWA req_to_token table filled from `swa_slots` exactly as the real runner's is
(from slot_write_start). Each computed position's KV is written to its SWA slot too, and each
query reads the earlier positions of its window (q - W + 1 .. q - 1, the convention of
runner/attention/window.py) back through the SWA table: every one must have an SWA slot whose
content is that position's KV. An SWA page freed while a window still needs it, or handed to
another request meanwhile, fails here (the other request overwrites it)."""
from __future__ import annotations

from kvstrata.protocol import RunnerOutput, SchedulerOutput
from tests.unit.fake_runner import FakeRunner, _fill_page, copy_pages


class FakeSWARunner(FakeRunner):
    def __init__(self, window: int, **kw):
        super().__init__(**kw)
        self.window = window
        self.swa_kv: dict[int, tuple[int, int]] = {}
        self.swa_rows: dict[int, dict[int, int]] = {}
        self.swa_reads = 0  # window positions read back through the SWA table
        # HiCache: the host SWA pool, under the full copy's host page ids (swa_hiradix.py)
        self.swa_host: dict[int, tuple[int, int]] = {}
        self.moved_swa_pages = {"d2h": 0, "h2d": 0}

    def _copy(self, op) -> None:
        if not op.swa_only:  # (a revived tombstone's full pages stay as they are)
            super()._copy(op)
        pairs = [(s, h) for s, h in zip(op.swa_pages, op.host_pages) if s]
        swa, host = [s for s, _ in pairs], [h for _, h in pairs]
        if op.kind == "d2h":
            copy_pages(self.swa_kv, self.swa_host, swa, host, self.page_size)
        else:
            copy_pages(self.swa_host, self.swa_kv, host, swa, self.page_size)
        self.moved_swa_pages[op.kind] += len(pairs)

    # HiCache L3: an op's swa_keys store / read the host SWA pool's page (swa_storage.py)
    def _host_swa_page(self, page: int) -> tuple:
        P = self.page_size
        return tuple(self.swa_host.get(page * P + o) for o in range(P))

    def _set_host_swa_page(self, page: int, entries: tuple) -> None:
        _fill_page(self.swa_host, page, self.page_size, entries)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for s in so.scheduled:
            assert s.swa_slots is not None and len(s.swa_slots) == len(s.slots), (
                f"{s.rid}: swa_slots {s.swa_slots} do not match slots {s.slots}")
            row = self.swa_rows.setdefault(s.row, {})
            for i, slot in enumerate(s.swa_slots):
                row[s.slot_write_start + i] = slot
        out = super().execute(so)  # computes the full pool (and moves accepted tree drafts)
        P = self.page_size
        for s in so.scheduled:
            row, swa_row = self.rows[s.row], self.swa_rows[s.row]
            # The first query's window reaches furthest back; later ones read fresh KV.
            for p in range(max(s.start_pos - self.window + 1, 0), s.start_pos):
                slot = swa_row.get(p, 0)
                assert slot >= P, (f"{s.rid}: position {p} is in the window of the query at "
                                   f"{s.start_pos} (W={self.window}) but has no SWA slot")
                assert self.swa_kv.get(slot) == self.kv[row[p]], (
                    f"{s.rid}: SWA slot {slot} of position {p} holds {self.swa_kv.get(slot)}, "
                    f"the full pool {self.kv[row[p]]} (page freed or reused too early)")
                self.swa_reads += 1
            for p in range(s.start_pos, s.start_pos + len(s.token_ids)):
                slot = swa_row[p]
                assert slot >= P, f"{s.rid}: computed position {p} has no SWA slot"
                self.swa_kv[slot] = self.kv[row[p]]
        return out

    def check_req_to_token(self, expected: dict[int, list[int]], swa_expected=None) -> None:
        """The SWA table's entries each row's next window reads (cache/invariants.py
        expected_swa_rows), beside the full rows."""
        super().check_req_to_token(expected)
        assert swa_expected is not None, "an SWA pool but no expected SWA rows"
        for row, (start, slots) in swa_expected.items():
            got = [self.swa_rows.get(row, {}).get(start + i) for i in range(len(slots))]
            assert got == list(slots), f"SWA row {row} from {start}: {got} != {slots}"
