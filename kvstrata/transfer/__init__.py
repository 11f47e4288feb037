"""Moves KV bytes asynchronously: device <-> host jobs now; host <-> storage and disagg later."""
from kvstrata.transfer.controller import TransferController, TransferJob

__all__ = ["TransferController", "TransferJob"]
