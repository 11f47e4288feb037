"""The recurrent layers' transcendental element-wise ops (sigmoid, SiLU, softplus), as torch
runs them or position-free (csrc/pointwise.c, deterministic inference).

A Gated DeltaNet or Mamba2 mixer (runner/models/gated_deltanet.py, mamba2_mixer.py) applies
its activations through `mixer.act`: `TORCH` by default, `POSITION_FREE` once deterministic
inference pinned the model (runner/models/hybrid_fixed.py). torch's element-wise kernels run a
flattened tensor in vector runs (SLEEF's exp) with a scalar tail (libm's) and split it among
threads at any element, so an element's bits followed how many tokens shared the forward;
the position-free ops compute each element in float32 with the same scalar libm code and
round once to the input's dtype, as torch's do for bf16. (Seen on the AMX box at 2 threads:
torch's sigmoid / SiLU / softplus over 100003 floats gave 1 / 1 / 2 elements other bits when
the tensor started 5 elements later; these ops none, tests/correctness/
test_deterministic_hybrid.py.) Scalar libm costs ~2.3x torch's vector SiLU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.runner.recurrent import _pointwise

_SIGMOID, _SILU, _SOFTPLUS = 0, 1, 2
SOFTPLUS_THRESHOLD = 20.0  # torch's default: above it softplus(x) is x


def _apply(kind: int, x: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    if x.device.type != "cpu":
        raise ValueError(f"position-free element-wise ops run on the CPU, not {x.device}")
    src = x.float().contiguous()
    out = torch.empty_like(src)
    _pointwise.apply(kind, src.data_ptr(), out.data_ptr(), src.numel(), threshold,
                     torch.get_num_threads())
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _apply(_SIGMOID, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _apply(_SILU, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return _apply(_SOFTPLUS, x, SOFTPLUS_THRESHOLD)


class TorchActivations:
    sigmoid = staticmethod(torch.sigmoid)
    silu = staticmethod(F.silu)
    softplus = staticmethod(F.softplus)


class PositionFreeActivations:
    sigmoid = staticmethod(sigmoid)
    silu = staticmethod(silu)
    softplus = staticmethod(softplus)


TORCH = TorchActivations()
POSITION_FREE = PositionFreeActivations()
