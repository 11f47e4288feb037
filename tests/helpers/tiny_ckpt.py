"""Tiny random-weight checkpoints from transformers' own config classes, saved as safetensors,
and their transformers reference model: the one builder the family helpers (moe_ckpt.py,
hybrid_ckpt.py) share. Each family says how its weights are drawn away from transformers'
near-identity init (`redraw(name, tensor)`, over parameters and buffers: a norm of ones or a
zero bias would hide a dropped one)."""
from __future__ import annotations

from typing import Any, Callable


def build_checkpoint(config: Any, path: str, seed: int,
                     redraw: Callable[[str, Any], None] | None = None) -> str:
    import itertools

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if redraw is not None:
        with torch.no_grad():
            for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
                redraw(name, t)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_model(path: str, dtype=None):
    """transformers' model of checkpoint `path` (float32, eager attention by default)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype or torch.float32, attn_implementation="eager").eval()


# The sublayers' output projections (attention, Gated DeltaNet / Mamba, MLP and expert down).
OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def scale_outputs(tensors: dict, scale: float, prefix: str = "") -> None:
    """Every output projection under `prefix` times `scale`, in place: the residual stream
    stays mostly the token's embedding, so each logit row is mostly a bigram's -- what lets
    an MTP layer that passes the embedding through draft well (NEXTN tests)."""
    for name in tensors:
        if name.startswith(prefix) and name.endswith(OUTPUT_PROJECTIONS):
            tensors[name] = tensors[name] * scale
