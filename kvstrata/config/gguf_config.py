"""The config fields of a Gemma 2 / Gemma 3 GGUF file (llama.cpp archs `gemma2`, `gemma3`)
that transformers' GGUF config conversion drops, read the way llama.cpp reads the file
(gpt-oss files: config/gguf_gpt_oss.py, the recurrent hybrids' files:
config/gguf_hybrid.py,
the same way).

transformers maps the generic keys (sizes, heads, eps, sliding window, one rope base) and
leaves the rest at its config classes' defaults, which are not the file's: Gemma 2's
soft-caps (the file's `attn_logit_softcapping` / `final_logit_softcapping`), Gemma 3's
global rope scaling (`rope.scaling.type` / `.factor`) and final soft-cap, and the attention
scale (`query_pre_attn_scalar` defaults to 256 whatever the head size). What the file cannot
say, llama.cpp (llama-model.cpp, its Gemma hparams) fixes by convention, and so do we:
  - attention scale 1/sqrt(n_embd / n_head) for the 27B models (46 layers: Gemma 2; 62:
    Gemma 3), else 1/sqrt(head_dim): query_pre_attn_scalar = that denominator squared;
  - layers: Gemma 2 alternates local / global, Gemma 3 has a global layer every 6th
    (`attention.sliding_window_pattern`, when a file names it: a period, or a flag per layer);
  - Gemma 3's local layers: rope base 10000 (`rope.freq_base_swa` when named), no scaling;
  - missing keys: llama.cpp's defaults (Gemma 2: window 4096, soft-caps 50 / 30; rope base
    10000).
`complete_gguf_config` rewrites the converted config.json with these (config/model_source.py).
"""
from __future__ import annotations

import json
import os
from typing import Any

from kvstrata.config import gguf_families, gguf_gpt_oss, gguf_hybrid
from kvstrata.config.gguf_header import read_header, read_metadata

GEMMA_ARCHS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B by layer count
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train default, and Gemma 3's local base
_GEMMA2_SOFTCAPS = (50.0, 30.0)  # llama.cpp's hparams defaults: attention, final logits
_GEMMA2_WINDOW = 4096
_KEYS = ("block_count", "embedding_length", "attention.head_count", "attention.key_length",
         "attention.sliding_window", "attention.sliding_window_pattern",
         "attn_logit_softcapping", "final_logit_softcapping", "rope.freq_base",
         "rope.freq_base_swa", "rope.scaling.type", "rope.scaling.factor")


# llama.cpp's archs (gguf.MODEL_ARCH_NAMES) whose layers keep recurrent state and whose
# GGUF files kvstrata does not build: the families it serves from HF safetensors
# (config/hf_recurrent.py) and their relatives. mamba2, nemotron_h, nemotron_h_moe,
# granitehybrid, qwen35, qwen35moe, qwen3next and falcon-h1 files are built
# (config/gguf_hybrid.py, runner/models/gguf_hybrid_weights.py).
RECURRENT_GGUF_ARCHS = ("mamba", "jamba")


def refuse_recurrent_arch(arch: str | None, gguf_path: str) -> None:
    """ValueError for a GGUF file of a recurrent (SSM / linear-attention) arch that is not
    built: the GGUF loader maps the tensors of llama.cpp's mamba2, nemotron_h,
    nemotron_h_moe, granitehybrid, qwen35, qwen35moe, qwen3next and falcon-h1 archs only
    (Mamba 1 and Jamba are not served from safetensors either), and transformers converts
    none of these archs' configs."""
    if arch in RECURRENT_GGUF_ARCHS:
        raise ValueError(f"GGUF {arch} ({os.path.basename(gguf_path)}): a model with "
                         f"recurrent (SSM / linear-attention) state is built from GGUF files "
                         f"of llama.cpp's mamba2, nemotron_h, nemotron_h_moe, granitehybrid, "
                         f"qwen35, qwen35moe, qwen3next and falcon-h1 archs only (this arch's "
                         f"tensors are not mapped); serve its HF safetensors checkpoint")


def gemma_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """Config fields of a gemma2 / gemma3 file from its metadata ({} for other archs)."""
    arch = meta.get("general.architecture")
    if arch not in GEMMA_ARCHS:
        return {}

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    n_layer, n_embd, n_head = get("block_count"), get("embedding_length"), \
        get("attention.head_count")
    if isinstance(n_head, list):
        raise ValueError(f"GGUF {arch}: a head count per layer is not supported")
    head_dim = get("attention.key_length", n_embd // n_head)
    scalar = n_embd // n_head if n_layer == _LAYERS_27B[arch] else head_dim
    window = get("attention.sliding_window", _GEMMA2_WINDOW if arch == "gemma2" else None)
    if window is None:
        raise ValueError(f"GGUF {arch}: no {arch}.attention.sliding_window (llama.cpp "
                         f"requires it)")
    fields: dict[str, Any] = {
        "architectures": [GEMMA_ARCHS[arch]], "head_dim": head_dim,
        "query_pre_attn_scalar": scalar, "sliding_window": window,
        "layer_types": _layer_types(arch, n_layer, get("attention.sliding_window_pattern"))}
    base = float(get("rope.freq_base", _ROPE_BASE))
    if arch == "gemma2":
        attn_cap, final_cap = _GEMMA2_SOFTCAPS
        fields.update(attn_logit_softcapping=float(get("attn_logit_softcapping", attn_cap)),
                      final_logit_softcapping=float(get("final_logit_softcapping", final_cap)),
                      rope_parameters={"rope_type": "default", "rope_theta": base})
        return fields
    final_cap = get("final_logit_softcapping")
    fields.update(attn_logit_softcapping=None,
                  final_logit_softcapping=None if not final_cap else float(final_cap),
                  rope_parameters={
                      "sliding_attention": {"rope_type": "default", "rope_theta": float(
                          get("rope.freq_base_swa", _ROPE_BASE))},
                      "full_attention": {"rope_theta": base, **_rope_scaling(arch, get)}})
    return fields


def _layer_types(arch: str, n_layer: int, pattern: Any, period: int | None = None
                 ) -> list[str]:
    """llama.cpp's set_swa_pattern(n): layer i is local iff n == 0 or i % n < n - 1; a
    per-layer array of flags says it directly (true: local). `period`: the arch's default n."""
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise ValueError(f"GGUF {arch}: attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {n_layer} layers")
        local = [bool(p) for p in pattern]
    else:
        n = (period or _SWA_PERIOD[arch]) if pattern is None else int(pattern)
        local = [n == 0 or i % n < n - 1 for i in range(n_layer)]
    return ["sliding_attention" if x else "full_attention" for x in local]


def _rope_scaling(arch: str, get) -> dict[str, Any]:
    """Gemma 3's global layers: llama.cpp applies the file's linear scaling there."""
    kind = get("rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default"}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
    raise ValueError(f"GGUF {arch}: rope.scaling.type {kind!r} is not supported (none or "
                     f"linear, as Gemma 3 checkpoints convert)")


def arch_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """The config fields this module completes for the file's arch: Gemma 2 / 3, gpt-oss
    (config/gguf_gpt_oss.py); {} for the archs transformers converts whole."""
    if meta.get("general.architecture") == gguf_gpt_oss.ARCH:
        return gguf_gpt_oss.gpt_oss_fields(meta, _layer_types)
    return gemma_fields(meta)


def _arch_metadata(gguf_path: str) -> dict[str, Any]:
    return read_metadata(gguf_path, ["general.architecture", "llama.expert_count"] + [
        f"{arch}.{key}" for arch in GEMMA_ARCHS for key in _KEYS] + [
        f"{gguf_gpt_oss.ARCH}.{key}" for key in gguf_gpt_oss.KEYS])


def gguf_model_fields(gguf_path: str) -> dict[str, Any]:
    """A Gemma, gpt-oss, recurrent hybrid (config/gguf_hybrid.py) or gguf_families.py file's
    config.json fields the resolution rules read (model_type, layers and their kinds,
    windows, soft-caps, sinks: ModelInfo.from_model_path), from the header alone -- no
    conversion, no transformers; {} for other archs (llama, qwen2, qwen3: no windows a GGUF
    names); ValueError for a recurrent arch that is not built."""
    meta = _arch_metadata(gguf_path)
    arch = meta.get("general.architecture")
    refuse_recurrent_arch(arch, gguf_path)
    if arch in gguf_hybrid.ARCHITECTURES:
        return own_gguf_config(gguf_path)
    if gguf_families.is_family_file(meta):  # Phi-3's window: hybrid SWA memory as from HF
        return gguf_families.family_config(gguf_path, {})
    fields = arch_fields(meta)
    if not fields:
        return {}
    return {"model_type": "gemma3_text" if arch == "gemma3" else arch,
            "num_hidden_layers": meta[f"{arch}.block_count"], **fields}


_TOKEN_IDS = gguf_hybrid.TOKEN_IDS
_OWN_ARCHS = (gguf_gpt_oss.ARCH, *gguf_hybrid.ARCHITECTURES)


def own_gguf_config(gguf_path: str) -> dict[str, Any] | None:
    """The whole config.json of a file whose arch transformers' GGUF conversion cannot
    convert, from its header; None for the others. The families of config/gguf_families.py
    (Qwen2/3-MoE, Mixtral, GLM-4.5, DeepSeek V2 / V3, Phi-3, SmolLM3, OLMo 2, GLM-4): why
    there. gpt-oss: transformers 5.25's conversion reads each rope.scaling value as its key's
    length field and fails on every YaRN file (the released ones), and its tokenizer loader
    converts the config first -- so the tokenizer is built without it
    (config/model_source.py). mamba2 / nemotron_h(_moe) / granitehybrid / qwen35(moe) /
    qwen3next / falcon-h1: transformers has no conversion for them (config/gguf_hybrid.py)."""
    family = gguf_families.family_config(gguf_path, _TOKEN_IDS)
    if family is not None:  # MoE and dense families beyond llama / qwen: all from the header
        return family
    header = read_header(gguf_path, ["general.architecture", *_TOKEN_IDS.values()] + [
        f"{gguf_gpt_oss.ARCH}.{key}" for key in gguf_gpt_oss.KEYS] + [
        f"{arch}.{key}" for arch in gguf_hybrid.ARCHITECTURES for key in gguf_hybrid.KEYS])
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in _OWN_ARCHS:
        return None
    dims = {t.name: t.dims for t in header.tensors}
    if arch in gguf_hybrid.ARCHITECTURES:
        return {**gguf_hybrid.hybrid_fields(meta, dims), **gguf_hybrid.token_ids(meta)}
    if "token_embd.weight" not in dims:
        raise ValueError(f"GGUF {gguf_gpt_oss.ARCH} ({os.path.basename(gguf_path)}): no "
                         f"token_embd.weight")
    return {**arch_fields(meta), "vocab_size": int(dims["token_embd.weight"][1]),
            "tie_word_embeddings": "output.weight" not in dims,  # transformers' rule
            **{field: meta[key] for field, key in _TOKEN_IDS.items() if key in meta}}


def complete_gguf_config(config_dir: str, gguf_path: str) -> None:
    """Rewrite `config_dir`/config.json (transformers' conversion of `gguf_path`) with the
    fields above; other archs' configs are left as converted."""
    fields = arch_fields(_arch_metadata(gguf_path))
    if not fields:
        return
    path = os.path.join(config_dir, "config.json")
    with open(path, encoding="utf-8") as fh:
        config = json.load(fh)
    config.pop("_sliding_window_pattern", None)  # transformers' derived copy of the default
    config.update(fields)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)


__all__ = ["GEMMA_ARCHS", "RECURRENT_GGUF_ARCHS", "arch_fields", "complete_gguf_config",
           "gemma_fields", "own_gguf_config",
           "gguf_model_fields", "refuse_recurrent_arch"]
