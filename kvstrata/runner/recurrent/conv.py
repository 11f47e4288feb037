"""The causal depthwise conv1d in front of a recurrent layer's scan (kernel K, 4 in every
released model), with SiLU, over a request's new tokens and its conv window.

The window is the last K - 1 inputs before the chunk (oldest first; zeros before the first
token), so a chunk's conv is the one the whole sequence would have computed: prefill runs it
over [window | chunk] in one F.conv1d; decode runs every row's [window | token] as one
multiply-add over K taps. The window after the chunk is the last K - 1 columns of the
concatenation (the state the pool keeps).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_chunk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               window: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [L, Cd] one request's new inputs; weight [Cd, K]; window [Cd, K - 1] (None: zeros).
    Returns (silu(conv) [L, Cd] in x's dtype, the concatenation [Cd, K - 1 + L] whose
    columns j + 1 .. j + K - 1 are the window after token j)."""
    kernel = weight.shape[-1]
    if window is None:
        window = x.new_zeros(x.shape[1], kernel - 1)
    full = torch.cat([window.to(x.dtype), x.t()], dim=1)
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], bias,
                   groups=x.shape[1])[0]
    return F.silu(out).t().to(x.dtype), full


def conv_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row. x [N, Cd]; windows [N, Cd, K - 1]. Returns (silu(conv) [N, Cd] in
    x's dtype, the new windows [N, Cd, K - 1] in the windows' dtype)."""
    full = torch.cat([windows.to(x.dtype), x[:, :, None]], dim=2)
    out = (full.float() * weight.float()).sum(-1)  # float32 sum, as F.conv1d accumulates
    if bias is not None:
        out = out + bias.float()
    return F.silu(out).to(x.dtype), full[:, :, 1:].to(windows.dtype)
