"""Rotary position embedding, HF "rotate_half" convention (the layout of HF checkpoints;
GGUF llama weights are un-permuted into it by the loader).

cos/sin are computed once per forward for the batch's positions (float32, like HF) and
shared by every layer.
"""
from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs use
    rope_theta + rope_scaling. Normalise to one dict with at least rope_type/rope_theta."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def compute_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)})")


class RotaryEmbedding:
    def __init__(self, head_dim: int, params: dict, device: torch.device):
        self.inv_freq = compute_inv_freq(head_dim, params).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, signed sin of shape [T, 1, D] (broadcast over heads).

        The sin's first half is negated: rotate_half(x) * sin == swap_halves(x) * signed_sin
        exactly (a sign flip is exact), which saves apply_rope a negation per layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> x * cos + rotate_half(x) * sin, with `sin` signed as cos_sin returns it:
    3 kernels (cat, mul, addcmul) instead of 5."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)
