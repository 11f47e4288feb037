"""A token's logprob with its id: the unit of every logprob list that crosses a process or
the scheduler/runner seam (its own module: scheduler_output and disagg both use it)."""
from __future__ import annotations

import msgspec


class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


__all__ = ["TopLogprob"]
