"""Attention backends over the paged KV pool."""
from kvstrata.runner.attention.torch_native import TorchNativeAttnBackend

__all__ = ["TorchNativeAttnBackend"]
