"""req_to_token: per running request, the KV slot of each of its token positions.

An int64 tensor (num_rows + 1, max_context_len). Row 0 is reserved (padding rows of a batch
point there) and unwritten entries read 0, the padding-sink slot, so a stray read is harmless.
Rows are handed out by the torch-free scheduler; this class only owns the tensor.
"""
from __future__ import annotations

import torch

from kvstrata.kv import _rowcopy


class ReqToTokenTable:
    def __init__(self, num_rows: int, max_context_len: int, device: torch.device | str):
        self.num_rows = num_rows
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.table = torch.zeros((num_rows + 1, max_context_len), dtype=torch.int64,
                                 device=self.device)

    def write(self, row: int, start: int, slots) -> None:
        """Record `slots` (list or tensor) at positions start .. start + len(slots) - 1."""
        n = len(slots)
        if n == 0:
            return
        if not 1 <= row <= self.num_rows:
            raise IndexError(f"row {row} out of range 1..{self.num_rows}")
        if start < 0 or start + n > self.max_context_len:
            raise IndexError(f"positions {start}..{start + n - 1} exceed max_context_len "
                             f"{self.max_context_len}")
        if not isinstance(slots, torch.Tensor):
            slots = torch.tensor(slots, dtype=torch.int64)
        self.table[row, start:start + n] = slots.to(self.device)

    def write_many(self, rows: list[int], starts: list[int], slots: list[list[int]]) -> None:
        """All requests' writes of one step as a single index_put (one host->device copy)."""
        r_idx: list[int] = []
        c_idx: list[int] = []
        vals: list[int] = []
        for row, start, s in zip(rows, starts, slots):
            if not s:
                continue
            if not 1 <= row <= self.num_rows or start < 0 or start + len(s) > self.max_context_len:
                raise IndexError(f"row {row} positions {start}..{start + len(s) - 1} out of "
                                 f"range (rows 1..{self.num_rows}, context "
                                 f"{self.max_context_len})")
            r_idx.extend([row] * len(s))
            c_idx.extend(range(start, start + len(s)))
            vals.extend(s)
        if not vals:
            return
        packed = torch.tensor([r_idx, c_idx, vals], dtype=torch.int64).to(self.device)
        self.table[packed[0], packed[1]] = packed[2]

    def slots_of(self, rows, lens) -> torch.Tensor:
        """Positions 0 .. lens[i] - 1 of each of `rows`, concatenated (int64, on the table's
        device): the key slots of a batch of decode queries. One C pass on the CPU
        (kv/csrc/rowcopy.c row_prefixes; torch's masked select took ~0.85 ms of a 32-request
        decode step), a masked select elsewhere."""
        if self.device.type != "cpu":
            lens_t = torch.tensor(lens, dtype=torch.int64, device=self.device)
            longest = int(max(lens, default=0))
            visible = torch.arange(longest, device=self.device)[None, :] < lens_t[:, None]
            rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
            return self.table[rows_t, :longest][visible]
        rows_lens = torch.tensor([list(rows), list(lens)], dtype=torch.int64).reshape(2, -1)
        out = torch.empty(int(rows_lens[1].sum()) if len(rows) else 0, dtype=torch.int64)
        _rowcopy.row_prefixes(self.table.data_ptr(), self.table.shape[0], self.table.shape[1],
                              rows_lens[0].data_ptr(), rows_lens[1].data_ptr(), len(rows),
                              out.data_ptr(), out.numel())
        return out

    def clear(self, row: int) -> None:
        self.table[row].zero_()

    def check_rows(self, expected: dict[int, list[int]]) -> None:
        for row, slots in expected.items():
            got = self.table[row, :len(slots)].tolist()
            assert got == list(slots), (
                f"req_to_token row {row} holds {got[:16]}..., the scheduler expects "
                f"{list(slots)[:16]}...")

    def check_spans(self, expected: dict[int, tuple[int, list[int]]], name: str) -> None:
        """Like check_rows for entries from a start position on: row -> (start, slots)."""
        for row, (start, slots) in expected.items():
            got = self.table[row, start:start + len(slots)].tolist()
            assert got == list(slots), (
                f"{name} row {row} from {start} holds {got[:16]}..., the scheduler expects "
                f"{list(slots)[:16]}...")
