"""Attention backends over the paged KV pool.

  torch_native.py  paged attention in plain torch (SDPA over gathered K/V; CPU and CUDA),
                   with the CPU kernels below where they apply
  pieces.py        its per-step plan: the attention pieces
  piece_planner.py the builders of those pieces (a mixin of the backend)
  window.py        its sliding windows, attention sinks and logit soft-capping
  paged_decode.py  the CPU decode and prefill attention kernels (`_paged_decode`, csrc/)
  mla_dense.py     dense MLA attention over the MLA pool (DeepSeek-V2 / V3)
  dsa_sparse.py    DSA sparse MLA attention over the MLA + indexer pool
  dsa_topk.py      DSA top-k selection (positions or slots)
  dsa_seed.py      the PD seed of DSA: top-k positions from the prefill, remapped to slots
  mla_fixed.py     deterministic inference's MLA / DSA attention: every query in the paged
                   decode kernel over latent rows, the indexer's scores in one order
"""
from kvstrata.runner.attention.torch_native import TorchNativeAttnBackend

__all__ = ["TorchNativeAttnBackend"]
