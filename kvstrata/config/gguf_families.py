"""The config of GGUF files of the families beyond llama / qwen2 / qwen3 / gemma / gpt-oss that
llama.cpp's convert_hf_to_gguf.py exports and kvstrata serves from HF safetensors, built from
the header the way llama.cpp reads it (its hparams for the arch):

  llama.cpp arch   written by (convert_hf_to_gguf.py)   served as
  qwen2moe         Qwen2MoeModel                         Qwen2MoeForCausalLM
  qwen3moe         Qwen3MoeModel                         Qwen3MoeForCausalLM
  llama + experts  LlamaModel (Mixtral)                  MixtralForCausalLM
  phi3             Phi3MiniModel                         Phi3ForCausalLM
  olmo2            Olmo2Model                            Olmo2ForCausalLM
  glm4             Glm4Model                             Glm4ForCausalLM
  smollm3          SmolLM3Model (LlamaModel's q/k        SmolLM3ForCausalLM
                   permutation)
  glm4moe          Glm4MoeModel                          Glm4MoeForCausalLM (GLM-4.5)
  deepseek2        DeepseekV2Model                       DeepseekV3ForCausalLM (sigmoid
                                                         gating) / DeepseekV2ForCausalLM
                                                         (config/gguf_deepseek.py)

Why not transformers' GGUF config conversion: it converts none of olmo2 / glm4 / glm4moe /
smollm3 / deepseek2, reads a Mixtral file as a dense llama (it maps no expert key of the
llama arch), and leaves each expert's width (expert_feed_forward_length) and Qwen2-MoE's
shared expert width at its config classes' defaults. Here every field the runner reads comes
from the file:
  - sizes: block_count, embedding_length, feed_forward_length, attention.head_count /
    head_count_kv, attention.key_length (head_dim; llama.cpp's default n_embd / n_head),
    attention.layer_norm_rms_epsilon, context_length, the vocabulary from token_embd, tied
    embeddings when there is no output.weight (llama.cpp's and transformers' rule);
  - experts: expert_count, expert_used_count, expert_feed_forward_length,
    expert_shared_feed_forward_length; routing as llama.cpp's graph for the arch fixes it
    (softmax top-k; weights renormalised for qwen3moe and Mixtral, not for qwen2moe);
    GLM-4.5's expert_shared_count, leading_dense_block_count, expert_weights_scale /
    _norm and sigmoid gating with the exp_probs_b correction (no expert groups);
  - RoPE: rope.freq_base; rope.dimension_count over the head (Phi-3 / GLM-4's partial rotary);
    Phi-3's LongRoPE from the file's rope_factors_short / rope_factors_long tensors,
    rope.scaling.original_context_length and rope.scaling.attn_factor (llama.cpp's default 1);
  - biases: q/k/v biases where the file has blk.0.attn_q.bias.
What llama.cpp would read from such a file but this builds nothing for is refused by key: a
rope scaling type (none besides Phi-3's LongRoPE factors), an expert gating function other than
softmax (sigmoid for GLM-4.5), scaled expert weights (but GLM-4.5's), a layer without experts
in an MoE file (but GLM-4.5's leading dense ones), expert groups, OLMo 3's windows.
GLM-4.5's NextN layers (blocks past num_hidden_layers) are not read: transformers runs none.
"""
from __future__ import annotations

import math
import os
import struct
from typing import Any

from kvstrata.config import gguf_deepseek
from kvstrata.config.gguf_header import GGUFHeader, arch_getters, read_header

# llama.cpp arch -> (architectures[0], model_type); llama's entry only for a file with experts
FAMILIES = {"qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
            "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
            "llama": ("MixtralForCausalLM", "mixtral"),
            "phi3": ("Phi3ForCausalLM", "phi3"),
            "olmo2": ("Olmo2ForCausalLM", "olmo2"),
            "glm4": ("Glm4ForCausalLM", "glm4"),
            "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
            "glm4moe": ("Glm4MoeForCausalLM", "glm4_moe"),
            # V2 or V3 by its gating: config/gguf_deepseek.py
            "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2")}
_MOE = ("qwen2moe", "qwen3moe", "llama")
_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train default
# SmolLM3: every 4th layer has no rope -- llama.cpp's smollm3 graph skips it where
# (layer + 1) % n_no_rope_layer_step == 0, a constant 4 no key can change
_NO_ROPE_LAYER_STEP = 4
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*
_F32, _F16 = 0, 1  # GGML types of a rope factor tensor
KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length",
        "attention.value_length", "attention.layer_norm_rms_epsilon",
        *gguf_deepseek.KEYS,
        "attention.sliding_window", "rope.freq_base", "rope.dimension_count",
        "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
        "rope.scaling.attn_factor", "expert_count", "expert_used_count",
        "expert_feed_forward_length", "expert_shared_feed_forward_length",
        "expert_gating_func", "expert_weights_scale", "expert_weights_norm",
        "leading_dense_block_count", "expert_shared_count", "expert_group_count",
        "expert_group_used_count", "nextn_predict_layers")


def header_keys(arch: str) -> list[str]:
    return [f"{arch}.{key}" for key in KEYS]


def is_family_file(meta: dict[str, Any]) -> bool:
    """A file this module configures: one of FAMILIES' archs (llama only with experts)."""
    arch = meta.get("general.architecture")
    if arch == "llama":
        return bool(meta.get("llama.expert_count"))
    return arch in FAMILIES


def family_fields(header: GGUFHeader, gguf_path: str) -> dict[str, Any]:
    """config.json fields of a FAMILIES file (is_family_file) from its header."""
    meta = header.metadata
    arch = meta["general.architecture"]
    architecture, model_type = FAMILIES[arch]
    dims = {t.name: t.dims for t in header.tensors}
    get, need = arch_getters(meta, arch)

    # GLM-4.5's NextN (MTP) layers are blocks past the model's (block_count counts them):
    # not run, as transformers runs none
    nextn = int(get("nextn_predict_layers", 0) or 0)
    n_layer, n_embd = int(need("block_count")) - nextn, int(need("embedding_length"))
    n_head, n_kv = need("attention.head_count"), get("attention.head_count_kv")
    if isinstance(n_head, list) or isinstance(n_kv, list):
        raise ValueError(f"GGUF {arch}: a head count per layer is not supported")
    head_dim = int(get("attention.key_length", n_embd // int(n_head)))
    mla = arch == gguf_deepseek.ARCH  # MLA as MQA: its key / value lengths are the latent's
    if int(get("attention.value_length", head_dim)) != head_dim and not mla:
        raise ValueError(f"GGUF {arch}: attention.value_length != key_length is not supported")
    rot = head_dim if mla else int(get("rope.dimension_count", head_dim))
    fields: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type,
        "num_hidden_layers": n_layer, "hidden_size": n_embd,
        "num_attention_heads": int(n_head),
        "num_key_value_heads": int(n_head if n_kv is None else n_kv),
        "head_dim": head_dim, "intermediate_size": int(need("feed_forward_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        # MLA's rope (YaRN): gguf_deepseek.py's
        "rope_parameters": {} if mla else _rope(arch, get, header, gguf_path, head_dim, rot)}
    if "partial_rotary_factor" in fields["rope_parameters"]:  # where config classes read it
        fields["partial_rotary_factor"] = fields["rope_parameters"]["partial_rotary_factor"]
    if get("context_length"):
        fields["max_position_embeddings"] = int(get("context_length"))
    if "token_embd.weight" not in dims:
        raise ValueError(f"GGUF {arch} ({os.path.basename(gguf_path)}): no token_embd.weight")
    fields["vocab_size"] = int(dims["token_embd.weight"][1])
    fields["tie_word_embeddings"] = "output.weight" not in dims
    bias = "blk.0.attn_q.bias" in dims
    if arch == "qwen2moe":
        fields["qkv_bias"] = bias
    elif arch in ("qwen3moe", "olmo2", "glm4", "smollm3", "glm4moe"):
        fields["attention_bias"] = bias
    elif bias:
        raise ValueError(f"GGUF {arch}: q/k/v biases (blk.0.attn_q.bias) are not supported")
    if arch in _MOE:
        fields.update(_experts(arch, get, need, dims, n_layer))
    if mla:
        fields.update(gguf_deepseek.deepseek_fields(get, need, dims, n_layer, n_embd,
                                                    int(n_head)))
    if arch == "glm4moe":
        fields.update(_glm4_moe_experts(get, need, dims, n_layer),
                      use_qk_norm="blk.0.attn_q_norm.weight" in dims,
                      num_nextn_predict_layers=nextn)
    if arch == "smollm3":  # transformers' no_rope_layers: 1 = the layer ropes
        fields.update(no_rope_layers=[int((i + 1) % _NO_ROPE_LAYER_STEP != 0)
                                      for i in range(n_layer)], use_sliding_window=False)
    window = get("attention.sliding_window")
    if window and arch == "phi3":
        fields["sliding_window"] = int(window)
    elif window:
        raise ValueError(f"GGUF {arch}: attention.sliding_window is not supported for this "
                         f"arch (OLMo 3's windowed layers are not built)")
    if arch == "phi3" and "original_max_position_embeddings" in fields["rope_parameters"]:
        fields["original_max_position_embeddings"] = \
            fields["rope_parameters"]["original_max_position_embeddings"]
    return fields


def _experts(arch: str, get, need, dims: dict, n_layer: int) -> dict[str, Any]:
    gating = get("expert_gating_func")
    if gating is not None and int(gating) != _GATING_SOFTMAX:
        raise ValueError(f"GGUF {arch}: expert_gating_func {gating} is not supported "
                         f"(softmax only)")
    scale = get("expert_weights_scale")
    if scale is not None and float(scale) not in (0.0, 1.0):
        raise ValueError(f"GGUF {arch}: expert_weights_scale {scale} is not supported")
    for key in ("leading_dense_block_count", "expert_weights_norm"):
        if get(key):
            raise ValueError(f"GGUF {arch}: {arch}.{key} is not supported")
    dense = [i for i in range(n_layer) if f"blk.{i}.ffn_gate_inp.weight" not in dims]
    if dense:
        raise ValueError(f"GGUF {arch}: layers without experts ({dense[:4]}) are not "
                         f"supported (llama.cpp's {arch} has experts on every layer)")
    out: dict[str, Any] = {"num_experts_per_tok": int(need("expert_used_count"))}
    if arch == "llama":
        return {**out, "num_local_experts": int(need("expert_count")), "sliding_window": None}
    out.update(num_experts=int(need("expert_count")),
               moe_intermediate_size=int(need("expert_feed_forward_length")),
               norm_topk_prob=arch == "qwen3moe", decoder_sparse_step=1, mlp_only_layers=[],
               use_sliding_window=False)
    if arch == "qwen2moe":
        shared = get("expert_shared_feed_forward_length")
        if shared is None or "blk.0.ffn_gate_shexp.weight" not in dims:
            raise ValueError(f"GGUF {arch}: no shared expert (expert_shared_feed_forward_"
                             f"length, ffn_*_shexp): not supported")
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def _glm4_moe_experts(get, need, dims: dict, n_layer: int) -> dict[str, Any]:
    """GLM-4.5's MoE as llama.cpp's glm4moe graph runs it: sigmoid scores plus the
    exp_probs_b correction to choose, weights renormalised (expert_weights_norm) and scaled
    (expert_weights_scale), shared experts, dense leading layers; no expert groups."""
    arch = "glm4moe"
    gating = get("expert_gating_func")
    if gating is None or int(gating) != _GATING_SIGMOID:
        raise ValueError(f"GGUF {arch}: expert_gating_func {gating} is not supported "
                         f"(sigmoid only, as the converter writes it)")
    groups = int(get("expert_group_count", 1) or 1)
    if groups > 1:
        raise ValueError(f"GGUF {arch}: expert_group_count {groups} is not supported")
    dense = int(get("leading_dense_block_count", 0) or 0)
    layers = [i for i in range(n_layer) if f"blk.{i}.ffn_gate_inp.weight" not in dims]
    if layers != list(range(dense)):
        raise ValueError(f"GGUF {arch}: layers without experts {layers[:4]} are not the "
                         f"leading_dense_block_count {dense} first ones")
    if any(f"blk.{i}.exp_probs_b.bias" not in dims for i in range(dense, n_layer)):
        raise ValueError(f"GGUF {arch}: an MoE layer without exp_probs_b (the router's "
                         f"correction bias) is not supported")
    return {"n_routed_experts": int(need("expert_count")),
            "num_experts_per_tok": int(need("expert_used_count")),
            "moe_intermediate_size": int(need("expert_feed_forward_length")),
            "n_shared_experts": int(need("expert_shared_count")),
            "first_k_dense_replace": dense, "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0) or 1.0),
            "norm_topk_prob": bool(get("expert_weights_norm", False))}


def _rope(arch: str, get, header: GGUFHeader, gguf_path: str, head_dim: int,
          rot: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default",
                              "rope_theta": float(get("rope.freq_base", _ROPE_BASE))}
    if rot != head_dim:
        if arch not in ("phi3", "glm4", "glm4moe"):
            raise ValueError(f"GGUF {arch}: rope.dimension_count {rot} (a rope over part of "
                             f"the head of {head_dim}) is not supported")
        params["partial_rotary_factor"] = rot / head_dim
    kind = get("rope.scaling.type", "none")
    if kind != "none":
        raise ValueError(f"GGUF {arch}: rope.scaling.type {kind!r} is not supported")
    names = {t.name for t in header.tensors}
    factors = ("rope_factors_short.weight", "rope_factors_long.weight")
    if "rope_freqs.weight" in names:
        raise ValueError(f"GGUF {arch}: rope_freqs.weight (llama3-style rope factors) is not "
                         f"supported for this arch")
    if not any(f in names for f in factors):
        return params
    if arch != "phi3" or not all(f in names for f in factors):
        raise ValueError(f"GGUF {arch}: rope factor tensors {sorted(names & set(factors))} "
                         f"are not supported")
    orig = get("rope.scaling.original_context_length")
    if orig is None:
        raise ValueError(f"GGUF {arch}: LongRoPE factors without "
                         f"rope.scaling.original_context_length")
    short, long = (_float_tensor(header, gguf_path, f) for f in factors)
    # llama.cpp multiplies the rotation by the file's attn_factor (1 when it names none);
    # transformers would derive one from the context lengths: name it
    attn = float(get("rope.scaling.attn_factor", 1.0))
    if not math.isfinite(attn):
        raise ValueError(f"GGUF {arch}: rope.scaling.attn_factor {attn} is not finite")
    return {**params, "rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": int(orig), "attention_factor": attn}


def _float_tensor(header: GGUFHeader, gguf_path: str, name: str) -> list[float]:
    """A small F32 / F16 tensor's values, read from the file (no numpy)."""
    info = next(t for t in header.tensors if t.name == name)
    if info.tensor_type not in (_F32, _F16):
        raise ValueError(f"GGUF: {name} of GGML type {info.tensor_type} (F32 / F16 only)")
    count = math.prod(info.dims)
    fmt, size = ("f", 4) if info.tensor_type == _F32 else ("e", 2)
    with open(gguf_path, "rb") as fh:
        fh.seek(header.data_start + info.offset)
        data = fh.read(count * size)
    return [float(v) for v in struct.unpack(f"<{count}{fmt}", data)]


def family_config(gguf_path: str, token_ids: dict[str, str]) -> dict[str, Any] | None:
    """The whole config.json of a FAMILIES file from its header (None for other files);
    `token_ids`: config field -> tokenizer.ggml key."""
    arch = read_header(gguf_path, ["general.architecture", "llama.expert_count"]
                       ).metadata.get("general.architecture")
    if arch not in FAMILIES:
        return None
    header = read_header(gguf_path, ["general.architecture", *token_ids.values(),
                                     *header_keys(arch)])
    if not is_family_file(header.metadata):
        return None
    meta = header.metadata
    return {**family_fields(header, gguf_path),
            **{field: meta[key] for field, key in token_ids.items() if key in meta}}


__all__ = ["FAMILIES", "KEYS", "family_config", "family_fields", "header_keys",
           "is_family_file"]
