"""A Gemma 2 / Gemma 3 HF checkpoint written as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py writes one (its Gemma2Model / Gemma3Model classes), with gguf's own
writer: the arch's metadata keys, a sentencepiece ("llama") vocabulary, llama.cpp's tensor
names (gguf.get_tensor_name_map), every `*norm.weight` stored as 1 + w (Gemma's RMSNorm
scale: the converter adds the 1), q/k rows not permuted (Gemma's rope is NEOX-style in
llama.cpp) and no output.weight (tied). Tensors stay float32, so the loaded model is the HF
one exactly.

What such a file cannot say, llama.cpp fixes by convention (config/gguf_config.py reads it
so): the attention scale is 1/sqrt(head_dim) unless the layer count is a 27B model's,
Gemma 3's local rope base is 10000 and every 6th layer is global, Gemma 2 alternates. A
checkpoint meant to round-trip must follow those (`gguf_compatible_config`).
"""
from __future__ import annotations

import os

import numpy as np

ARCH = {"gemma2": "GEMMA2", "gemma3": "GEMMA3"}


def gguf_compatible_config(arch: str):
    """tests/helpers/gemma_ckpt.py's tiny config with what GGUF can carry: the attention
    scale from head_dim (query_pre_attn_scalar = head_dim)."""
    from helpers.gemma_ckpt import tiny_gemma_config

    config = tiny_gemma_config(arch)
    config.query_pre_attn_scalar = config.head_dim
    return config


def _vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    """A sentencepiece vocabulary of n tokens: Gemma's special ids (pad 0, eos 1, bos 2,
    unk 3: CONTROL / UNKNOWN types), then pieces."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = [f"\u2581{a}{b}" if i % 2 else f"{a}{b}"
              for i, (a, b) in enumerate((a, b) for a in letters for b in letters)]
    tokens = specials + pieces[:n - len(specials)]
    types = [3, 3, 3, 2] + [1] * (n - len(specials))
    scores = [0.0] * len(specials) + [-float(i) for i in range(n - len(specials))]
    return tokens, scores, types


def add_text_model_params(w, config) -> None:
    """convert_hf_to_gguf.py's TextModel.set_gguf_parameters: the sizes every arch writes."""
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)


def add_special_token_ids(w, config) -> None:
    """The converter's SpecialVocab: the config's bos / eos / pad ids."""
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    w.add_pad_token_id(config.pad_token_id)


def write_gemma_gguf(hf_path: str, out_path: str, types: dict[str, str] | None = None,
                     reference: dict | None = None) -> str:
    """`hf_path` (a tiny Gemma 2 / Gemma 3 checkpoint, float32) as llama.cpp would convert it.
    `types`: a GGML type per weight (its HF name's last module: "q_proj", "embed_tokens") for
    the weights to quantize (gguf's quantizer), the rest float32; `reference` (a dict) gets
    each HF weight as the file holds it (dequantized by gguf)."""
    import gguf
    import torch
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_path)
    arch = "gemma3" if config.model_type == "gemma3_text" else config.model_type
    model_arch = getattr(gguf.MODEL_ARCH, ARCH[arch])
    state = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).state_dict()
    w = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[model_arch])
    w.add_name(os.path.basename(hf_path))
    add_text_model_params(w, config)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_sliding_window(config.sliding_window)
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters: no rope base, both soft-caps
        w.add_attn_logit_softcapping(config.attn_logit_softcapping)
        w.add_final_logit_softcapping(config.final_logit_softcapping)
    else:  # Gemma3Model: the global layers' rope (base, linear scaling), a final soft-cap if set
        rope = config.rope_parameters["full_attention"]
        w.add_rope_freq_base(rope["rope_theta"])
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
        if config.final_logit_softcapping:
            w.add_final_logit_softcapping(config.final_logit_softcapping)
    tokens, scores, token_types = _vocab(config.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(token_types)
    add_special_token_ids(w, config)
    w.add_unk_token_id(3)
    w.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight":
            continue  # tied: llama.cpp reads token_embd
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        assert name is not None, hf_name
        data = tensor.float()
        if hf_name.endswith("norm.weight"):
            data = data + 1  # Gemma's RMSNorm scale, as the converter stores it
        kind = (types or {}).get(base.rsplit(".", 1)[-1])
        if kind is None:
            w.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(data.numpy()))
            if reference is not None:
                reference[hf_name] = tensor.float()
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        stored = gguf.quants.quantize(data.numpy(), qtype)
        w.add_tensor(f"{name}.{suffix}", stored, raw_dtype=qtype)
        if reference is not None:
            reference[hf_name] = torch.from_numpy(
                gguf.quants.dequantize(stored, qtype).reshape(tuple(data.shape)).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path
