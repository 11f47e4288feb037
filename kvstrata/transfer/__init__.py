"""Moves KV bytes asynchronously: device <-> host jobs (controller.py), prefill -> decode
servers (disagg/); host <-> storage later."""
from kvstrata.transfer.controller import TransferController, TransferJob

__all__ = ["TransferController", "TransferJob"]
