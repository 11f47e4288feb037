"""A torch-free stand-in for the model runner that *checks* the KV bookkeeping.

It keeps a fake KV pool (slot -> (position, token)) and req_to_token rows exactly as the
scheduler describes them, and its "model" derives the next token from the sequence it reads
back through the row. Any bookkeeping bug (a wrong slot, a page reused while still in use, a
stale row entry) changes the output, so tests compare against `reference_tokens`.
"""
from __future__ import annotations

from kvstrata.protocol import RunnerOutput, SchedulerOutput


def next_token(tokens: list[int], vocab: int) -> int:
    h = 0
    for i, t in enumerate(tokens):
        h = (h * 31 + (i + 1) * (t + 7)) % 1_000_003
    return h % vocab


def reference_tokens(prompt: list[int], n: int, vocab: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq, vocab))
    return seq[len(prompt):]


def copy_pages(src: dict, dst: dict, src_pages: list[int], dst_pages: list[int], P: int) -> None:
    """Copy whole pages of a fake pool (slot -> (position, token)); empty slots stay empty."""
    for sp, dp in zip(src_pages, dst_pages):
        for off in range(P):
            if sp * P + off in src:
                dst[dp * P + off] = src[sp * P + off]
            else:
                dst.pop(dp * P + off, None)


class FakeRunner:
    def __init__(self, page_size: int = 1, vocab_size: int = 1000, max_context_len: int = 4096,
                 eos_token_ids: tuple[int, ...] = ()):
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.eos_token_ids = list(eos_token_ids)
        self.kv: dict[int, tuple[int, int]] = {}
        self.rows: dict[int, dict[int, int]] = {}
        self.known: dict[str, object] = {}
        self.steps: list[SchedulerOutput] = []
        self.host: dict[int, tuple[int, int]] = {}  # host slot -> (position, token)
        self.async_ops: list = []  # background d2h writes, completed one step later
        self.moved_pages = {"d2h": 0, "h2d": 0}

    def _copy(self, op) -> None:
        P = self.page_size
        src, dst = (self.kv, self.host) if op.kind == "d2h" else (self.host, self.kv)
        src_pages, dst_pages = ((op.device_pages, op.host_pages) if op.kind == "d2h"
                                else (op.host_pages, op.device_pages))
        copy_pages(src, dst, src_pages, dst_pages, P)
        self.moved_pages[op.kind] += len(src_pages)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.steps.append(so)
        finished = [op.job_id for op in self.async_ops]
        for op in self.async_ops:
            self._copy(op)
        self.async_ops = []
        for op in so.transfers:
            if op.sync:
                self._copy(op)
                finished.append(op.job_id)
            else:
                self.async_ops.append(op)
        for rid in so.freed_req_ids:
            del self.known[rid]
        for nr in so.new_requests:
            assert nr.req_id not in self.known, f"{nr.req_id} registered twice"
            self.known[nr.req_id] = nr
        ids, toks = [], []
        for s in so.scheduled:
            assert s.req_id in self.known, f"{s.req_id} scheduled but unknown to the runner"
            assert s.row != 0, "row 0 is the padding sink"
            row = self.rows.setdefault(s.row, {})
            for i, slot in enumerate(s.slots):
                row[s.slot_write_start + i] = slot
            for j, t in enumerate(s.token_ids):
                slot = row[s.start_pos + j]
                assert slot >= self.page_size, "page 0 is the padding sink"
                self.kv[slot] = (s.start_pos + j, t)
        for s in so.scheduled:
            if not s.sample:
                continue
            row = self.rows[s.row]
            seq = []
            for p in range(s.start_pos + len(s.token_ids)):
                pos, tok = self.kv[row[p]]
                assert pos == p, f"{s.req_id}: slot {row[p]} holds position {pos}, expected {p}"
                seq.append(tok)
            ids.append(s.req_id)
            toks.append(next_token(seq, self.vocab_size))
        n = len(ids)
        return RunnerOutput(ids, toks, [None] * n, [None] * n, finished_transfer_ids=finished)

    def check_req_to_token(self, expected: dict[int, list[int]]) -> None:
        for row, slots in expected.items():
            got = [self.rows.get(row, {}).get(i) for i in range(len(slots))]
            assert got == list(slots), f"row {row}: {got} != {slots}"
