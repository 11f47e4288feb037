"""Tiny random models of the GGUF-exported families beyond llama / qwen3 / gemma / gpt-oss,
each from transformers' own config class and written as llama.cpp's convert_hf_to_gguf.py
writes the arch (its metadata keys, gguf's tensor names, experts stacked [experts, out, in],
Mixtral's q/k rows permuted as LlamaModel permutes them, Phi-3's LongRoPE factors as
rope_factors_short / _long tensors), with gguf's own writer and quantizer:

  family     llama.cpp arch     what the file carries
  qwen2      qwen2              q/k/v biases (transformers' GGUF conversion reads it)
  qwen2_moe  qwen2moe           8 experts top-2, gated shared expert (its gate a vector),
                                q/k/v biases
  qwen3_moe  qwen3moe           8 experts top-2 (renormalised), q/k norms
  mixtral    llama + experts    8 experts top-2, q/k rows permuted
  phi3       phi3               fused attn_qkv / ffn_up, LongRoPE, 3/4 partial rotary, window 8
  olmo2      olmo2              output norms, whole-projection q/k norms
  glm4       glm4               sandwich norms, interleaved half rotary, fused ffn_up, biases
  smollm3    smollm3            4 layers: the 4th without rope (llama.cpp's fixed step), q/k
                                rows permuted
  deepseek_v3  deepseek2        MLA (q_lora_rank, kv_b_proj split into attn_k_b / attn_v_b),
                                YaRN (mscale = mscale_all_dim), sigmoid routing in 4 groups
  deepseek_v2_lite  deepseek2   MLA without q_lora_rank, attn_kv_b whole (older files),
                                softmax greedy top-2
  glm4_moe   glm4moe            GLM-4.5: a dense first layer, 8 experts top-2 by sigmoid with
                                a correction bias (drawn), renormalised and scaled by 2.5, a
                                shared expert, q/k norms, half rotary, biases; one NextN
                                block past the model's (block_count counts it; not read)

Every matrix is quantized with a type from TYPES (Q8_0, Q4_0, or left F32: the three side by
side in one file); norms, biases and the rope factors stay F32. The returned reference is
transformers' model holding the values the file holds (gguf's dequantization of them, rows
put back where the converter permuted them).
"""
from __future__ import annotations

import math
import re

import numpy as np

from helpers.decoder_gguf import add_sentencepiece_vocab, llama_cpp_permute, quantize_rows

FAMILIES = ("qwen2", "qwen2_moe", "qwen3_moe", "mixtral", "phi3", "olmo2", "glm4", "smollm3",
            "glm4_moe", "deepseek_v3", "deepseek_v2_lite")
MLA = ("deepseek_v3", "deepseek_v2_lite")
PERMUTED_QK = ("mixtral", "smollm3")  # LlamaModel.permute in the converter
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe", *MLA)
ARCH = {"qwen2": "QWEN2", "qwen2_moe": "QWEN2MOE", "qwen3_moe": "QWEN3MOE", "mixtral": "LLAMA",
        "phi3": "PHI3", "olmo2": "OLMO2", "glm4": "GLM4", "smollm3": "SMOLLM3",
        "glm4_moe": "GLM4_MOE", "deepseek_v3": "DEEPSEEK2", "deepseek_v2_lite": "DEEPSEEK2"}
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 300, 64, 4, 2, 16
EXPERTS, TOP_K = 8, 2
PHI3_WINDOW = 8
NEXTN = {"glm4_moe": 1}  # NextN (MTP) blocks the file holds past the model's
# GGML type by the weight's last module name (an expert stack by "experts.gate" / ".up" /
# ".down"); everything 1-D stays F32
TYPES = {"q_proj": "Q8_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q4_0",
         "qkv_proj": "Q8_0", "gate_proj": "Q4_0", "up_proj": "Q8_0", "down_proj": "F32",
         "gate_up_proj": "Q4_0", "experts.gate": "Q8_0", "experts.up": "Q4_0",
         "experts.down": "Q8_0", "gate": "F32",
         "embed_tokens": "Q8_0", "lm_head": "Q4_0", "q_a_proj": "Q8_0", "q_b_proj": "Q4_0",
         "kv_a_proj_with_mqa": "Q8_0", "attn_v_b": "Q8_0", "attn_k_b": "F32",
         "kv_b_proj": "Q4_0"}
MLA_DIMS = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
MLA_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 0.8, "mscale_all_dim": 0.8}


def family_config(family: str, hidden: int = HIDDEN, expert_width: int = 32, layers: int = 2):
    """`hidden` / `expert_width` (an expert's, and Mixtral's, intermediate size; the dense
    layers' is 3x it, Qwen2-MoE's shared expert's 2x): wider than the defaults where a
    K-quant needs rows of whole 256-value super-blocks (test_gguf_moe_packed.py,
    benchmarks/ab_gguf_moe.py)."""
    import torch
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=512, initializer_range=0.15, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    moe = dict(num_experts_per_tok=TOP_K, intermediate_size=3 * expert_width)
    if family == "qwen2":
        return tf.Qwen2Config(**common, intermediate_size=96)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, **moe, moe_intermediate_size=expert_width,
                                 shared_expert_intermediate_size=2 * expert_width,
                                 num_experts=EXPERTS,
                                 norm_topk_prob=False)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, **moe, head_dim=HEAD_DIM,
                                 moe_intermediate_size=expert_width,
                                 num_experts=EXPERTS, norm_topk_prob=True)
    if family == "mixtral":
        return tf.MixtralConfig(**common, num_experts_per_tok=TOP_K,
                                intermediate_size=expert_width,
                                num_local_experts=EXPERTS, sliding_window=None)
    if family == "phi3":  # the short factors: prompts stay below the original 256
        g = torch.Generator().manual_seed(3)
        half = int(HEAD_DIM * 0.75) // 2
        return tf.Phi3Config(**common, intermediate_size=96, sliding_window=PHI3_WINDOW,
                             original_max_position_embeddings=256, rope_parameters={
                                 "rope_type": "longrope", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.75,
                                 "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
                                 "long_factor": (4 + torch.rand(half, generator=g)).tolist()})
    if family == "olmo2":
        return tf.Olmo2Config(**common, intermediate_size=96)
    if family == "glm4":
        return tf.Glm4Config(**common, intermediate_size=96, head_dim=HEAD_DIM,
                             attention_bias=True)
    if family == "glm4_moe":
        return tf.Glm4MoeConfig(**common, **moe, head_dim=HEAD_DIM,
                                moe_intermediate_size=expert_width,
                                n_routed_experts=EXPERTS, n_shared_experts=1, n_group=1,
                                topk_group=1, first_k_dense_replace=1,
                                routed_scaling_factor=2.5, norm_topk_prob=True,
                                use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5)
    if family in MLA:
        mla = dict(**common, **moe, **MLA_DIMS, moe_intermediate_size=32,
                   n_routed_experts=EXPERTS, n_shared_experts=1, first_k_dense_replace=1)
        mla["num_key_value_heads"] = HEADS
        if family == "deepseek_v3":  # YaRN as V3 has it: mscale == mscale_all_dim
            return tf.DeepseekV3Config(**mla, q_lora_rank=32, routed_scaling_factor=2.5,
                                       norm_topk_prob=True, rope_parameters=MLA_YARN,
                                       n_group=4, topk_group=2)
        return tf.DeepseekV2Config(**mla, q_lora_rank=None, topk_method="greedy",
                                   routed_scaling_factor=1.0, n_group=1, topk_group=1)
    if family == "smollm3":  # no_rope_layer_interval 4 (its default): layer 3 has no rope
        return tf.SmolLM3Config(**{**common, "num_hidden_layers": 4}, intermediate_size=96,
                                no_rope_layer_interval=4)
    raise ValueError(family)


def _redraw(model) -> None:
    """Norms and biases away from transformers' ones / zeros (a dropped one would hide)."""
    import torch

    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                t.normal_(1, 0.3)
            elif name.endswith((".bias", "e_score_correction_bias")):
                t.normal_(0, 0.3)


def _write_params(w, family: str, config) -> None:
    """convert_hf_to_gguf.py's set_gguf_parameters for the arch."""
    import gguf

    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers + NEXTN.get(family, 0))
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(HEADS)
    w.add_head_count_kv(1 if family in MLA else KV_HEADS)  # MLA as MQA
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if family in ("qwen3_moe", "glm4", "glm4_moe"):  # configs with their own head_dim
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
    if family == "glm4_moe":  # Glm4MoeModel.set_gguf_parameters
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        w.add_expert_shared_count(config.n_shared_experts)
        w.add_leading_dense_block_count(config.first_k_dense_replace)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(config.routed_scaling_factor)
        w.add_expert_weights_norm(config.norm_topk_prob)
        w.add_nextn_predict_layers(NEXTN[family])
    if family in MLA:  # DeepseekV2Model.set_gguf_parameters
        _write_mla_params(w, family, config)
    if family in MOE_FAMILIES:
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(TOP_K)
    if family in ("qwen2_moe", "qwen3_moe"):
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if family in ("phi3", "glm4", "glm4_moe"):
        w.add_rope_dimension_count(int(HEAD_DIM * config.rope_parameters[
            "partial_rotary_factor"]))
    if family == "phi3":
        w.add_sliding_window(config.sliding_window)
        orig = config.original_max_position_embeddings
        scale = config.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
        w.add_rope_scaling_orig_ctx_len(orig)
        for kind in ("short", "long"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.asarray(
                config.rope_parameters[f"{kind}_factor"], dtype=np.float32))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)


def _write_mla_params(w, family: str, config) -> None:
    import gguf

    w.add_leading_dense_block_count(config.first_k_dense_replace)
    if config.q_lora_rank is not None:
        w.add_q_lora_rank(config.q_lora_rank)
    w.add_kv_lora_rank(config.kv_lora_rank)
    w.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    w.add_value_length(config.kv_lora_rank)
    w.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    w.add_value_length_mla(config.v_head_dim)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_expert_shared_count(config.n_shared_experts)
    w.add_expert_weights_scale(config.routed_scaling_factor)
    if family == "deepseek_v3":
        w.add_expert_weights_norm(config.norm_topk_prob)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(config.n_group)
        w.add_expert_group_used_count(config.topk_group)
    else:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_rope_dimension_count(config.qk_rope_head_dim)
    rope = config.rope_parameters
    if rope.get("rope_type") == "yarn":  # TextModel's yarn keys, DeepseekV2Model's log_mul
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _store(w, gguf_name: str, data: np.ndarray, kind: str,
           rng: np.random.Generator | None = None) -> np.ndarray:
    """Writes `data` as `kind` (a K-quant: random blocks drawn from `rng`, gguf has no
    quantizer for them); returns the values the file holds (float32, data's shape)."""
    import gguf

    if kind == "F32" or data.ndim == 1:
        w.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
        return data.astype(np.float32)
    rows = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, data.shape[-1])
    stored, qtype = quantize_rows(rows, kind, rng)
    stored = stored.reshape(*data.shape[:-1], stored.shape[-1])
    w.add_tensor(gguf_name, stored, raw_dtype=qtype)
    return gguf.quants.dequantize(stored, qtype).reshape(data.shape)


def _kind(types: dict[str, str], hf_name: str, key: str) -> str:
    """The type `types` gives weight `key` (a module name, "experts.gate" ...) of hf_name's
    layer: its "<layer>.<key>" entry first, then its "<key>" one, else F32."""
    parts = hf_name.split(".")
    layer = parts[2] if parts[:2] == ["model", "layers"] else None
    return types.get(f"{layer}.{key}", types.get(key, "F32"))


def _store_kv_b(w, hf_name: str, data: np.ndarray, config):
    """DeepseekV2Model.modify_tensors: kv_b_proj per head as k rows then v rows; attn_k_b is
    [heads, kv_lora, nope] (the k rows transposed), attn_v_b [heads, v, kv_lora]."""
    import torch

    layer, nope = hf_name.split(".")[2], config.qk_nope_head_dim
    kv = data.reshape(HEADS, nope + config.v_head_dim, data.shape[-1])
    k_b = _store(w, f"blk.{layer}.attn_k_b.weight",
                 np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1)), TYPES["attn_k_b"])
    v_b = _store(w, f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv[:, nope:]),
                 TYPES["attn_v_b"])
    return torch.from_numpy(np.ascontiguousarray(
        np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(data.shape)))


_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def write_family_gguf(family: str, out_path: str, seed: int = 11,
                      types: dict[str, str] | None = None, **dims):
    """Writes the file; returns transformers' float32 model holding the file's values.
    `types`: entries over TYPES, "<layer>.<key>" for one layer's; `dims`: family_config's."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    config = family_config(family, **dims)
    types = {**TYPES, **(types or {})}
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    _redraw(model)
    arch = getattr(gguf.MODEL_ARCH, ARCH[family])
    w = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(f"tiny-{family}")
    _write_params(w, family, config)
    add_sentencepiece_vocab(w, VOCAB)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    reference = {}
    for hf_name, tensor in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.numpy()
        experts = _EXPERTS_RE.match(hf_name)
        if experts:  # transformers' fused [E, 2I, H] gate|up / [E, H, I] down -> llama.cpp's
            layer, which = experts.groups()
            parts = ({"gate": data[:, :data.shape[1] // 2], "up": data[:, data.shape[1] // 2:]}
                     if which == "gate_up_proj" else {"down": data})
            held = {k: _store(w, f"blk.{layer}.ffn_{k}_exps.weight", v,
                              _kind(types, hf_name, f"experts.{k}"), rng)
                    for k, v in parts.items()}
            reference[hf_name] = torch.from_numpy(np.ascontiguousarray(
                np.concatenate([held["gate"], held["up"]], axis=1) if len(held) == 2
                else held["down"]))
            continue
        if hf_name.endswith("kv_b_proj.weight") and family == "deepseek_v3":
            # today's converter splits it (k_b / v_b); the V2-Lite file keeps it whole, as
            # files converted before that split do (attn_kv_b)
            reference[hf_name] = _store_kv_b(w, hf_name, data, config)
            continue
        if hf_name.endswith("e_score_correction_bias"):  # the converter's exp_probs_b.bias
            layer = hf_name.split(".")[2]
            reference[hf_name] = torch.from_numpy(_store(
                w, f"blk.{layer}.exp_probs_b.bias", data, "F32"))
            continue
        module = base.rsplit(".", 1)[-1]
        name = names.get_name(base)
        assert name is not None, hf_name
        order = np.arange(data.shape[0])
        heads = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(module) \
            if family in PERMUTED_QK else None
        if heads is not None:  # LlamaModel.permute: the rows llama.cpp reorders
            order = llama_cpp_permute(order, heads)
        if module == "shared_expert_gate":  # [1, hidden]: a vector in llama.cpp's files
            held = _store(w, f"{name}.{suffix}", data.reshape(-1), "F32")
            reference[hf_name] = torch.from_numpy(held.reshape(data.shape))
            continue
        kind = "F32" if suffix != "weight" else _kind(types, hf_name, module)
        held = _store(w, f"{name}.{suffix}", data[order], kind, rng)
        reference[hf_name] = torch.from_numpy(np.ascontiguousarray(held[np.argsort(order)]))
    for extra in range(NEXTN.get(family, 0)):  # a NextN block (ones: nothing reads it)
        block = config.num_hidden_layers + extra
        hidden = config.hidden_size
        w.add_tensor(f"blk.{block}.nextn.eh_proj.weight",
                     np.ones((hidden, 2 * hidden), dtype=np.float32))
        w.add_tensor(f"blk.{block}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.load_state_dict(reference, strict=True)
    return model
