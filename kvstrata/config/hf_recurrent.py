"""Which layers of a checkpoint keep recurrent state, read from its config.json (no torch).

A recurrent layer (Mamba / Mamba2, Gated DeltaNet "linear attention", a short convolution)
keeps a fixed-size state per request instead of per-token K/V; a model with any such layer
needs a state pool and the snapshot prefix cache (docs/architecture.md "Recurrent state").
Read from the fields that name the layer kinds, in the spellings a checkpoint may carry:

  layer_types               Qwen3-Next / Qwen3.5 "linear_attention"; Granite-4.0-H "mamba"
                            as its config.json writes it ("linear_attention" once transformers
                            5 has saved it); LFM2 "conv". A GraniteMoeHybrid config whose
                            layers are all "attention" keeps no state (SGLang checks the same).
  layers_block_type         Nemotron-H as transformers 5 saves it ("linear_attention"),
                            Zamba ("mamba" / "hybrid")
  hybrid_override_pattern   Nemotron-H's config.json: one character per layer, "M" = Mamba2
  model_type                models every layer of which keeps state (Mamba, Mamba2, Falcon-H1:
                            Mamba2 beside attention in every layer) or whose layer list is
                            derived from periods (Jamba: attention every attn_layer_period
                            layers, Mamba in the others)
A multimodal config (Qwen3.5) is read through its `text_config`.
"""
from __future__ import annotations

# layer kinds (as configs spell them) whose layer keeps recurrent state
RECURRENT_LAYER_KINDS = ("linear_attention", "mamba", "mamba2", "conv", "hybrid")
# model types every layer of which keeps state
ALL_RECURRENT_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba", "falcon_h1", "rwkv")


def recurrent_layers(cfg: dict) -> tuple[int, int, str] | None:
    """(recurrent layers, layers, where the config says so), or None when no layer of the
    model keeps recurrent state."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and not _own_layer_fields(cfg):
        found = recurrent_layers(text)
        return None if found is None else (*found[:2], f"text_config {found[2]}")
    for field in ("layer_types", "layers_block_type"):
        kinds = cfg.get(field)
        if isinstance(kinds, list) and kinds:
            n = sum(str(k).lower() in RECURRENT_LAYER_KINDS for k in kinds)
            return (n, len(kinds), f"{field}: {n} of {len(kinds)} layers recurrent") if n \
                else None
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        n = pattern.count("M")
        return (n, len(pattern), f"hybrid_override_pattern: {n} of {len(pattern)} layers "
                                 f"Mamba2 ('M')") if n else None
    model_type = str(cfg.get("model_type", "")).lower()
    layers = cfg.get("num_hidden_layers")
    layers = layers if isinstance(layers, int) and layers > 0 else 0
    if model_type in ALL_RECURRENT_MODEL_TYPES:
        return layers, layers, f"model_type {model_type}: every layer keeps state"
    if model_type == "jamba":
        period, offset = cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
        n = sum(i % period != offset for i in range(layers))
        return n, layers, f"model_type jamba: {n} of {layers} layers Mamba (attention every " \
                          f"{period} layers from {offset})"
    return None


def _own_layer_fields(cfg: dict) -> bool:
    return any(k in cfg for k in ("layer_types", "layers_block_type", "hybrid_override_pattern"))
