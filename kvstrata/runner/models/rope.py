"""Rotary position embedding, HF "rotate_half" convention (the layout of HF checkpoints;
GGUF llama weights are un-permuted into it by the loader).

cos/sin are computed once per forward for the batch's positions (float32, like HF) and
shared by every layer.
"""
from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, base, params)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)})")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, params: dict) -> torch.Tensor:
    """YaRN (DeepSeek-V3): dims that rotate fast keep their frequency (extrapolate), slow ones
    are divided by `factor` (interpolate), with a linear ramp between the correction bounds."""
    factor = float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    # 1 / (factor * base^(i/d)) exactly as the reference rounds it (not inv_freq / factor).
    pos_freqs = base ** (
        torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(params: dict) -> float:
    """Scale applied to cos and sin (YaRN's mscale ratio; 1 for the other rope types)."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale = float(params["factor"]), params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


class RotaryEmbedding:
    def __init__(self, head_dim: int, params: dict, device: torch.device):
        self.inv_freq = compute_inv_freq(head_dim, params).to(device)
        self.attention_factor = rope_attention_factor(params)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, signed sin of shape [T, 1, D] (broadcast over heads).

        The sin's first half is negated: rotate_half(x) * sin == swap_halves(x) * signed_sin
        exactly (a sign flip is exact), which saves apply_rope a negation per layer."""
        cos, sin = self.plain_cos_sin(positions)
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def plain_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> float32 cos, sin [T, D] as HF computes them (attention factor
        applied), for models that rotate in other layouts (deepseek_v32: interleaved)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> x * cos + rotate_half(x) * sin, with `sin` signed as cos_sin returns it:
    3 kernels (cat, mul, addcmul) instead of 5."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)
