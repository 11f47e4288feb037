"""A shared-memory all-reduce and all-gather for tensor-parallel ranks on one machine (the
CPU path SGLang takes when it can; gloo over loopback TCP costs ~450 us per call on a busy
2-core box, 60 calls per SmolLM2 decode step).

One file in /dev/shm, mapped by every local rank and unlinked as soon as all have mapped it
(nothing is left behind, even after a SIGKILL): a flag per rank (its own cache line) and,
twice over, a data slot per rank. A collective: bump the sequence number, copy the input
into this rank's slot of buffer `seq % 2`, publish the flag, wait until every flag has
reached `seq`, then combine the slots in rank order -- every rank adds the same numbers in
the same order, so every rank gets the same bits. The double buffer is what makes one
barrier enough: a rank writes buffer `seq % 2` only after seeing every flag at `seq - 1`,
and a rank raises its flag for `seq - 1` only after it finished reading `seq - 2`.

Ordering relies on x86's total store order (the data store before the flag store, the
flag load before the data loads): config/rules keep other CPUs, other devices and ranks on
several machines on gloo. Tensors larger than a slot go through gloo too.
"""
from __future__ import annotations

import os
import time
import uuid

import numpy as np
import torch

from kvstrata.runner.cpu import _cpu_ops
from kvstrata.runner.cpu.isa import isa_cap

FLAG_STRIDE = 8  # int64s per flag: one 64-byte cache line each
SPINS_BEFORE_YIELD = 200
C_SPINS = 20000  # spins per C call before the abort reason and timeout are checked
_C_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class ShmCollectives:
    def __init__(self, rank: int, size: int, path: str, slot_bytes: int, create: bool):
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.header = 64 * size
        total = self.header + 2 * size * slot_bytes
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        self.buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self.flags = self.buf[:self.header].numpy().view(np.int64)[::FLAG_STRIDE]
        self.seq = int(self.flags[rank])
        self.abort_reason: str | None = None  # set by the heartbeat: stop waiting
        self.timeout_s = 300.0

    @staticmethod
    def new_path() -> str:
        return f"/dev/shm/kvstrata-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.slot_bytes

    def _slot(self, buffer: int, rank: int, t: torch.Tensor) -> torch.Tensor:
        start = self.header + (buffer * self.size + rank) * self.slot_bytes
        n = t.numel() * t.element_size()
        return self.buf[start:start + n].view(t.dtype).view(t.shape)

    def _publish_and_wait(self, t: torch.Tensor) -> int:
        self.seq += 1
        seq, buffer = self.seq, self.seq % 2
        self._slot(buffer, self.rank, t).copy_(t)
        self.flags[self.rank] = seq
        spins, deadline = 0, None
        while self.flags.min() < seq:
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                os.sched_yield()  # more ranks than cores: let the others run
                if spins % 1000 == 0:
                    self._check_waiting(seq, deadline := deadline or time.monotonic())
        return buffer

    def _check_waiting(self, seq: int, since: float) -> None:
        if self.abort_reason is not None:
            raise RuntimeError(f"tensor parallelism: {self.abort_reason}")
        if time.monotonic() - since > self.timeout_s:
            late = [r for r in range(self.size) if self.flags[r] < seq]
            raise RuntimeError(f"tensor parallelism: ranks {late} did not reach collective "
                               f"{seq} within {self.timeout_s:.0f} s")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype in _C_DTYPES and t.is_contiguous() and t.device.type == "cpu":
            return self._all_reduce_c(t)
        buffer = self._publish_and_wait(t)
        acc = self._slot(buffer, 0, t).to(torch.float32 if t.dtype != torch.float32
                                          else t.dtype, copy=True)
        for r in range(1, self.size):
            acc += self._slot(buffer, r, t)
        t.copy_(acc)
        return t

    def _all_reduce_c(self, t: torch.Tensor) -> torch.Tensor:
        """The same protocol and sum in C (runner/cpu/csrc/cpu_ops.c): one call instead of ~15
        torch and numpy calls (~30-50 us of Python a collective, 61 a SmolLM2 step). It
        returns every C_SPINS spins still waiting, so the abort reason and timeout are
        checked as in _publish_and_wait."""
        self.seq += 1
        seq, published, since = self.seq, 0, None
        args = (self.buf.data_ptr(), self.header, self.slot_bytes, self.rank, self.size, seq,
                t.data_ptr(), t.numel(), _C_DTYPES[t.dtype])
        while not _cpu_ops.shm_all_reduce(*args, published, C_SPINS, isa_cap()):
            published = 1
            self._check_waiting(seq, since := since or time.monotonic())
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        buffer = self._publish_and_wait(t)
        return torch.cat([self._slot(buffer, r, t) for r in range(self.size)], dim=-1)


__all__ = ["ShmCollectives"]
