"""Rotary position embedding, HF "rotate_half" convention (the layout of HF checkpoints;
GGUF llama weights are un-permuted into it by the loader).

cos/sin are computed once per forward for the batch's positions (float32, like HF) and
shared by every layer.
"""
from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# Older spellings transformers still reads as the type after them (Phi-3's first configs: su).
_ROPE_TYPE_ALIASES = {"su": "longrope"}


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
    params["rope_type"] = _ROPE_TYPE_ALIASES.get(params["rope_type"], params["rope_type"])
    if "partial_rotary_factor" not in params and getattr(config, "partial_rotary_factor", None):
        params["partial_rotary_factor"] = config.partial_rotary_factor
    return params


def rotary_dim(head_dim: int, params: dict) -> int:
    """How many of a head's dims rotate (Phi-4-mini 3/4, GLM-4 1/2); the rest pass through."""
    return int(head_dim * float(params.get("partial_rotary_factor") or 1.0))


def _longrope_factor(params: dict, max_positions: int | None) -> float:
    """LongRoPE's context extension (Phi-3: max_position_embeddings over the original)."""
    if params.get("factor") is not None:
        return float(params["factor"])
    if max_positions is None:
        raise ValueError("rope_type 'longrope' without `factor` needs max_position_embeddings")
    return max_positions / float(params["original_max_position_embeddings"])


def compute_inv_freq(head_dim: int, params: dict, max_positions: int | None = None
                     ) -> torch.Tensor:
    """The frequencies of positions below the original context (`max_positions`: the config's
    max_position_embeddings, which dynamic and longrope read); RotaryEmbedding switches to the
    scaled ones beyond it."""
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
    if rope_type == "dynamic":
        # NTK base growth starts only past max_position_embeddings: below it, the default.
        return inv_freq
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, base, params["short_factor"])
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


def _longrope_inv_freq(dim: int, base: float, factors: list) -> torch.Tensor:
    # As transformers rounds it: 1 / (factor_i * base^(i/d)).
    ext = torch.tensor(factors, dtype=torch.float32)
    if ext.numel() != dim // 2:
        raise ValueError(f"rope_parameters long_factor / short_factor: {ext.numel()} values, "
                         f"the rotary dimension needs {dim // 2}")
    return 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _dynamic_inv_freq(dim: int, params: dict, max_positions: int, seq_len: torch.Tensor
                      ) -> torch.Tensor:
    """Dynamic NTK: [T] sequence lengths (each >= max_positions) -> [T, dim/2] frequencies
    of a base grown for that length, in float32 as transformers computes it."""
    factor = float(params["factor"])
    base = float(params["rope_theta"]) * (
        (factor * seq_len.float() / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_len.device).float() / dim
    return 1.0 / (base[:, None] ** exps[None, :])


def rope_attention_factor(params: dict, max_positions: int | None = None) -> float:
    """Scale applied to cos and sin (YaRN's mscale ratio, LongRoPE's sqrt(1 + log s / log L);
    1 for the other rope types)."""
    if params["rope_type"] == "longrope":
        if params.get("attention_factor") is not None:
            return float(params["attention_factor"])
        factor = _longrope_factor(params, max_positions)
        old_len = float(params["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
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
    """`head_dim`: the rotated dims of a head (rotary_dim()). `max_positions`: the config's
    max_position_embeddings (dynamic and longrope read it).

    Position-dependent types choose per token where transformers chooses per forward (from
    the batch's longest sequence, keeping keys already cached as they were rotated): longrope
    rotates a token at position >= original_max_position_embeddings with `long_factor`, below
    it with `short_factor`; dynamic grows the base for a token past max_position_embeddings
    to its own length (pos + 1). Within the original context both equal transformers exactly;
    past it a token's rotation no longer depends on what it is batched with (a serving
    engine's requirement: the same request must give the same tokens in any batch)."""

    def __init__(self, head_dim: int, params: dict, device: torch.device,
                 max_positions: int | None = None):
        rope_type = params["rope_type"]
        self.dim, self.params, self.max_positions = head_dim, params, max_positions
        self.inv_freq = compute_inv_freq(head_dim, params, max_positions).to(device)
        self.attention_factor = rope_attention_factor(params, max_positions)
        self.long_inv_freq: torch.Tensor | None = None
        self.switch_at: int | None = None  # first position whose frequencies differ
        if rope_type == "longrope":
            self.switch_at = int(params["original_max_position_embeddings"])
            self.long_inv_freq = _longrope_inv_freq(
                head_dim, float(params["rope_theta"]), params["long_factor"]).to(device)
        elif rope_type == "dynamic":
            if max_positions is None:
                raise ValueError("rope_type 'dynamic' needs max_position_embeddings")
            self.switch_at = int(max_positions)

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
        freqs = positions.float()[:, None] * self._token_inv_freq(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


    def _token_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """[1, D/2] frequencies for every token, or [T, D/2] when some token is past the
        switch (positions are on the model's device: one max() per forward, no sync on CPU)."""
        if self.switch_at is None or positions.numel() == 0 or (
                int(positions.max()) < self.switch_at):
            return self.inv_freq[None, :]
        beyond = (positions >= self.switch_at)[:, None]
        if self.long_inv_freq is not None:
            return torch.where(beyond, self.long_inv_freq[None, :], self.inv_freq[None, :])
        seq_len = torch.clamp(positions + 1, min=self.switch_at)
        grown = _dynamic_inv_freq(self.dim, self.params, self.switch_at, seq_len)
        return torch.where(beyond, grown, self.inv_freq[None, :])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] -> x * cos + rotate_half(x) * sin, with `sin` signed as cos_sin returns it:
    3 kernels (cat, mul, addcmul) instead of 5."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)
