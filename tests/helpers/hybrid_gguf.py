"""A tiny Mamba2 / Nemotron-H HF checkpoint (tests/helpers/hybrid_ckpt.py) written as a GGUF file
the way llama.cpp's convert_hf_to_gguf.py writes one (Mamba2Model; NemotronHModel through
GraniteHybridModel) with `--outtype q8_0`, with gguf's own writer and quantizer:
  - metadata: the arch's keys as the converter sets them (Mamba2: context 2**20, ssm.* sizes,
    time_step_rank = d_inner / head_dim; Nemotron-H: head_count_kv and feed_forward_length
    per layer, 0 where a layer has none, key / value length, ssm.*), a sentencepiece
    vocabulary with bos / pad / unk ids;
  - tensors: llama.cpp's names (gguf.get_tensor_name_map; dt_bias renamed dt_proj.bias first,
    as Mamba2Model.filter_tensors does), A stored as -exp(A_log) shaped (heads, 1), D as
    (heads, 1), conv1d squeezed to (channels, kernel), the gated norm as (groups, d_inner /
    groups), Nemotron-H's q / k rows permuted (LlamaModel.permute: GraniteHybridModel's
    undo_permute); types as the converter picks them: F32 for 1-D tensors, norms, conv1d and
    tensors without a .weight suffix (ssm_a, ssm_d), Q8_0 for the other matrices, F16 where a
    row is not whole Q8_0 blocks (the converter's fallback).
`reference_dir` gets an HF checkpoint of the values the file holds (each transform undone by
this file's own inverse: q / k rows by the inverse of an index permutation, A_log = log(-A)).
"""
from __future__ import annotations

import os
import shutil

import numpy as np

from helpers.decoder_gguf import llama_cpp_permute
from helpers.gemma_gguf import _vocab

ARCH = {"mamba2": "MAMBA2", "nemotron_h": "NEMOTRON_H"}
QUANT = "Q8_0"


def _metadata(w, arch: str, config) -> None:
    import gguf

    if arch == "mamba2":
        d_inner, heads = config.num_heads * config.head_dim, config.num_heads
        w.add_context_length(2 ** 20)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        state, groups, kernel = config.state_size, config.n_groups, config.conv_kernel
    else:
        d_inner, heads = config.mamba_num_heads * config.mamba_head_dim, config.mamba_num_heads
        kinds = config.layers_block_type
        w.add_context_length(2 ** 20)  # GraniteHybridModel: no rope
        w.add_feed_forward_length([config.intermediate_size if k == "mlp" else 0
                                   for k in kinds])
        w.add_head_count(config.num_attention_heads)
        w.add_head_count_kv([config.num_key_value_heads if k == "full_attention" else 0
                             for k in kinds])
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        w.add_rope_dimension_count(config.head_dim)
        w.add_rope_scaling_finetuned(False)
        w.add_vocab_size(config.vocab_size)
        state, groups, kernel = config.ssm_state_size, config.n_groups, config.conv_kernel
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_ssm_conv_kernel(kernel)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(state)
    w.add_ssm_time_step_rank(heads)
    w.add_ssm_group_count(groups)
    w.add_layer_norm_rms_eps(config.layer_norm_epsilon)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tokens, scores, token_types = _vocab(config.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(token_types)
    w.add_bos_token_id(config.bos_token_id)
    w.add_pad_token_id(config.pad_token_id)
    w.add_unk_token_id(3)


def _source_name(hf_name: str) -> tuple[str, str]:
    """(the converter's module name, suffix) of a state-dict name: backbone.* (transformers'
    Nemotron-H module is model.*), dt_bias as dt_proj.bias; A_log and D carry no suffix."""
    name = "backbone." + hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    if name.endswith(".dt_bias"):
        name = name[:-len("dt_bias")] + "dt_proj.bias"
    if name.endswith((".A_log", ".D")):
        return name, ""
    base, suffix = name.rsplit(".", 1)
    return base, "." + suffix


def _stored(gguf_name: str, arr: np.ndarray):
    """(data for add_tensor, raw GGML type or None, the values as the file holds them)."""
    import gguf

    is_float = (arr.ndim <= 1 or gguf_name.endswith("_norm.weight") or "ssm_conv1d" in gguf_name
                or not gguf_name.endswith(".weight"))
    if is_float:
        data = np.ascontiguousarray(arr, dtype=np.float32)
        return data, None, data
    if arr.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[QUANT]][0]:
        data = np.ascontiguousarray(arr, dtype=np.float16)
        return data, None, data.astype(np.float32)
    qtype = gguf.GGMLQuantizationType[QUANT]
    data = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)
    return data, qtype, gguf.quants.dequantize(data, qtype).reshape(arr.shape)


def write_hybrid_gguf(arch: str, hf_path: str, out_path: str, reference_dir: str) -> str:
    import gguf
    import safetensors.torch as st
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_path)
    state = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).state_dict()
    model_arch = getattr(gguf.MODEL_ARCH, ARCH[arch])
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    w = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[model_arch])
    w.add_name(os.path.basename(hf_path))
    _metadata(w, arch, config)
    reference = {}
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = _source_name(hf_name)
        mapped = names.get_name(base)
        assert mapped is not None, hf_name
        gguf_name = mapped + suffix
        a = tensor.float()
        if hf_name.endswith(".A_log"):
            a = (-torch.exp(a)).reshape(-1, 1)  # the converter's A, in torch as it does it
        elif hf_name.endswith((".D",)):
            a = a.reshape(-1, 1)
        elif hf_name.endswith("mixer.norm.weight"):
            a = a.reshape(config.n_groups, -1)
        elif hf_name.endswith("conv1d.weight"):
            a = a.squeeze()
        order = np.arange(a.shape[0])  # the rows as stored
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (config.num_attention_heads if "q_proj" in hf_name
                     else config.num_key_value_heads)
            order = llama_cpp_permute(order, heads)
        arr = a.numpy()[order]
        data, qtype, values = _stored(gguf_name, arr)
        w.add_tensor(gguf_name, data, raw_dtype=qtype)
        values = np.asarray(values, dtype=np.float32)[np.argsort(order)]
        if hf_name.endswith(".A_log"):
            values = np.log(-values)
        reference[hf_name] = torch.from_numpy(
            np.ascontiguousarray(values.reshape(tuple(tensor.shape))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.makedirs(reference_dir, exist_ok=True)
    shutil.copy(os.path.join(hf_path, "config.json"), reference_dir)
    st.save_file(reference, os.path.join(reference_dir, "model.safetensors"),
                 metadata={"format": "pt"})
    return out_path
