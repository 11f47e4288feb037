"""A tiny Mamba2 / Nemotron-H / Granite-4.0-H / Qwen3.5 / Qwen3-Next HF checkpoint
(tests/helpers/hybrid_ckpt.py) written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py
writes one (Mamba2Model; NemotronHModel and GraniteHybridModel; Qwen3_5TextModel;
Qwen3NextModel) with `--outtype q8_0`, with gguf's own writer and quantizer:
  - metadata: the arch's keys as the converter sets them (Mamba2: context 2**20, ssm.* sizes,
    time_step_rank = d_inner / head_dim; Nemotron-H: head_count_kv and feed_forward_length
    per layer, 0 where a layer has none, key / value length, ssm.*), a sentencepiece
    vocabulary with bos / pad / unk ids;
  - tensors: llama.cpp's names (gguf.get_tensor_name_map; dt_bias renamed dt_proj.bias first,
    as Mamba2Model.filter_tensors does), A stored as -exp(A_log) shaped (heads, 1), D as
    (heads, 1), conv1d squeezed to (channels, kernel), the gated norm as (groups, d_inner /
    groups), the attention's q / k rows permuted (LlamaModel.permute: GraniteHybridModel's
    undo_permute), Granite's input_linear split into gate / up halves (GraniteMoeModel:
    ffn_gate_exps / ffn_up_exps, ffn_gate_shexp / ffn_up_shexp); Granite's multipliers as
    *_scale keys, rope.scaling.finetuned as its rope switch; Qwen3.5's norms but the gated one
    as 1 + w and its value heads from grouped by key head to tiled (value rows of in_proj_qkv,
    _z, _b, _a, A_log, dt_bias, the conv's value channels; out_proj's columns),
    full_attention_interval 4 and its MRoPE sections; Qwen3-Next's in_proj_qkvz split into
    attn_qkv ([q, k, v] of all heads) and attn_gate (z), its experts stacked per layer
    (Qwen2MoeModel), its norms as 1 + w; types as the converter picks
    them: F32 for 1-D tensors, norms, conv1d, the router and tensors without a .weight suffix
    (ssm_a, ssm_d), Q8_0 for the other matrices, F16 where a row is not whole Q8_0 blocks
    (the converter's fallback).
`reference_dir` gets an HF checkpoint of the values the file holds (each transform undone by
this file's own inverse: q / k rows by the inverse of an index permutation, A_log = log(-A)).
"""
from __future__ import annotations

import os
import shutil

import numpy as np

from helpers.decoder_gguf import llama_cpp_permute
from helpers.gemma_gguf import _vocab

ARCH = {"mamba2": "MAMBA2", "nemotron_h": "NEMOTRON_H", "granite": "GRANITE_HYBRID",
        "qwen3_5": "QWEN35", "qwen3_5_moe": "QWEN35MOE", "qwen3_next": "QWEN3NEXT"}
QWEN = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
QUANT = "Q8_0"


def _metadata(w, arch: str, config) -> None:
    if arch == "mamba2":
        d_inner, heads = config.num_heads * config.head_dim, config.num_heads
        w.add_context_length(2 ** 20)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        state, groups, kernel = config.state_size, config.n_groups, config.conv_kernel
        eps = config.layer_norm_epsilon
    elif arch == "nemotron_h":
        d_inner, heads = config.mamba_num_heads * config.mamba_head_dim, config.mamba_num_heads
        kinds = config.layers_block_type
        w.add_context_length(2 ** 20)  # GraniteHybridModel: no rope
        w.add_feed_forward_length([config.intermediate_size if k == "mlp" else 0
                                   for k in kinds])
        _attention_metadata(w, config, [k == "full_attention" for k in kinds])
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        w.add_rope_dimension_count(config.head_dim)
        w.add_rope_scaling_finetuned(False)
        state, groups, kernel = config.ssm_state_size, config.n_groups, config.conv_kernel
        eps = config.layer_norm_epsilon
        # TextModel.set_gguf_parameters: the config's layer_norm_epsilon (it has no
        # rms_norm_eps) goes to attention.layer_norm_epsilon, as llama.cpp reads it
        return ssm_metadata(w, config, d_inner, heads, state, groups, kernel, eps, rms_key=False)
    elif arch in QWEN:  # Qwen3_5TextModel / Qwen3NextModel (Qwen2MoeModel's keys first)
        d_inner, heads = (config.linear_value_head_dim * config.linear_num_value_heads,
                          config.linear_num_value_heads)
        w.add_context_length(config.max_position_embeddings)
        if arch != "qwen3_5_moe":  # its config has no intermediate_size: the key is not set
            w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count(config.num_attention_heads)
        w.add_head_count_kv(config.num_key_value_heads)
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        rope = config.rope_parameters
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_full_attention_interval(4)
        w.add_rope_dimension_count(int(config.head_dim * rope["partial_rotary_factor"]))
        if arch != "qwen3_next":
            w.add_rope_dimension_sections([11, 11, 10, 0])
        if arch != "qwen3_5":
            w.add_expert_count(config.num_experts)
            w.add_expert_used_count(config.num_experts_per_tok)
            w.add_expert_feed_forward_length(config.moe_intermediate_size)
            w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        state, groups = config.linear_key_head_dim, config.linear_num_key_heads
        kernel, eps = config.linear_conv_kernel_dim, config.rms_norm_eps
    else:  # GraniteHybridModel (GraniteMoeModel's keys, then the Mamba2 ones)
        d_inner, heads = config.mamba_expand * config.hidden_size, config.mamba_n_heads
        rope = config.position_embedding_type == "rope"
        w.add_context_length(config.max_position_embeddings if rope else 2 ** 20)
        w.add_feed_forward_length(config.intermediate_size)
        _attention_metadata(w, config, [k in ("attention", "full_attention")
                                        for k in config.layers_block_type])
        w.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        w.add_rope_freq_base(config.rope_parameters["rope_theta"])
        w.add_rope_scaling_finetuned(rope)
        w.add_expert_count(config.num_local_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
        w.add_attention_scale(config.attention_multiplier)
        w.add_embedding_scale(config.embedding_multiplier)
        w.add_residual_scale(config.residual_multiplier)
        w.add_logit_scale(config.logits_scaling)
        state, groups, kernel = config.mamba_d_state, config.mamba_n_groups, config.mamba_d_conv
        eps = config.rms_norm_eps
    ssm_metadata(w, config, d_inner, heads, state, groups, kernel, eps)


def ssm_metadata(w, config, d_inner: int, heads: int, state: int, groups: int, kernel: int,
                 eps: float, rms_key: bool = True) -> None:
    """The keys every hybrid file carries: sizes, the Mamba2 / Gated DeltaNet ssm.* keys,
    the eps (attention.layer_norm_rms_epsilon, or layer_norm_epsilon where not rms_key),
    the file type and a sentencepiece vocabulary with bos / pad / unk ids."""
    import gguf

    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_ssm_conv_kernel(kernel)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(state)
    w.add_ssm_time_step_rank(heads)
    w.add_ssm_group_count(groups)
    if rms_key:
        w.add_layer_norm_rms_eps(eps)
    else:
        w.add_layer_norm_eps(eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tokens, scores, token_types = _vocab(config.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(token_types)
    w.add_bos_token_id(config.bos_token_id)
    w.add_pad_token_id(config.pad_token_id)
    w.add_unk_token_id(3)


def _attention_metadata(w, config, attention: list[bool]) -> None:
    """head_count, and head_count_kv per layer: 0 where a layer has no attention."""
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv([config.num_key_value_heads if a else 0 for a in attention])
    w.add_vocab_size(config.vocab_size)


def _source_name(arch: str, hf_name: str) -> tuple[str, str]:
    """(the converter's module name, suffix) of a state-dict name: backbone.* for Nemotron-H
    (transformers' module is model.*), dt_bias as dt_proj.bias; A_log and D carry no suffix."""
    name = hf_name
    if arch == "nemotron_h" and name.startswith("model."):
        name = "backbone." + name[len("model."):]
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
                or gguf_name.endswith("ffn_gate_inp.weight") or not gguf_name.endswith(".weight"))
    if is_float:
        data = np.ascontiguousarray(arr, dtype=np.float32)
        return data, None, data
    if arr.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[QUANT]][0]:
        data = np.ascontiguousarray(arr, dtype=np.float16)
        return data, None, data.astype(np.float32)
    qtype = gguf.GGMLQuantizationType[QUANT]
    data = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)
    return data, qtype, gguf.quants.dequantize(data, qtype).reshape(arr.shape)


def _converted(arch: str, config, names, hf_name: str, a):
    """(llama.cpp's name, tensor) pairs the converter writes for one state-dict tensor."""
    import torch

    if hf_name.endswith("input_linear.weight"):  # GraniteMoeModel: gate | up halves apart
        layer = hf_name.split(".")[2]
        experts = "block_sparse_moe" in hf_name
        kind = "exps" if experts else "shexp" if config.num_local_experts else ""
        gate, up = a.split(a.shape[-2] // 2, dim=-2)
        sep = "_" if kind else ""
        return [(f"blk.{layer}.ffn_gate{sep}{kind}.weight", gate),
                (f"blk.{layer}.ffn_up{sep}{kind}.weight", up)]
    if hf_name.endswith("in_proj_qkvz.weight"):  # Qwen3NextModel: [q, k, v] and z apart
        layer = hf_name.split(".")[2]
        qkv, z = _split_qkvz(config, a)
        return [(f"blk.{layer}.attn_qkv.weight", qkv), (f"blk.{layer}.attn_gate.weight", z)]
    base, suffix = _source_name(arch, hf_name)
    mapped = names.get_name(base)
    assert mapped is not None, hf_name
    if hf_name.endswith(".A_log"):
        a = -torch.exp(a)  # the converter's A, in torch as it does it
        a = a if arch in QWEN else a.reshape(-1, 1)  # Qwen3NextModel keeps it 1-D
    elif arch in QWEN and hf_name.endswith("norm.weight") and "linear_attn" not in hf_name:
        a = a + 1  # Qwen3NextModel: the zero-centred norms as their scale 1 + w
    elif hf_name.endswith(".D"):
        a = a.reshape(-1, 1)
    elif hf_name.endswith(("mixer.norm.weight", "mamba.norm.weight")):
        a = a.reshape(config.n_groups if arch != "granite" else config.mamba_n_groups, -1)
    elif hf_name.endswith("conv1d.weight"):
        a = a.squeeze()
    return [(mapped + suffix, a)]


def _split_qkvz(config, a):
    """Qwen3NextModel's split of in_proj_qkvz ([q, k, v, z] per key head) into [q, k, v] of
    all heads and z, as it does it (on the transposed matrix)."""
    import torch

    nk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    vz = config.linear_num_value_heads // nk * config.linear_value_head_dim
    cols = a.permute(1, 0).contiguous().view(a.shape[1], nk, 2 * dk + 2 * vz)
    q, k, v, z = (x.contiguous().view(a.shape[1], -1)
                  for x in torch.split(cols, [dk, dk, vz, vz], dim=-1))
    return torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous(), z.permute(1, 0).contiguous()


def _stored_order(arch: str, config, hf_name: str, a):
    """(row order, column order or None) the converter stores a tensor in: LlamaModel's q / k
    permutation (GraniteHybridModel.undo_permute), Qwen3.5's value heads from grouped by key
    head to tiled (_LinearAttentionVReorderBase) where there are more value than key heads."""
    rows, cols = np.arange(a.shape[0]), None
    if arch == "qwen3_next":
        return rows, cols
    if arch not in ("qwen3_5", "qwen3_5_moe"):
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (config.num_attention_heads if "q_proj" in hf_name
                     else config.num_key_value_heads)
            rows = llama_cpp_permute(rows, heads)
        return rows, cols
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    if "linear_attn" not in hf_name or nk == nv:
        return rows, cols

    def tiled(prefix: int, head: int):  # grouped [K, V/K, head] -> tiled [V/K, K, head]
        v = np.arange(nv * head).reshape(nk, nv // nk, head).swapaxes(0, 1).reshape(-1)
        return np.concatenate([np.arange(prefix), prefix + v])

    qk, dv = 2 * nk * config.linear_key_head_dim, config.linear_value_head_dim
    if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        rows = tiled(qk, dv)
    elif hf_name.endswith("in_proj_z.weight"):
        rows = tiled(0, dv)
    elif hf_name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        rows = tiled(0, 1)
    elif hf_name.endswith("out_proj.weight"):
        cols = tiled(0, dv)
    return rows, cols


def _write_expert_stacks(w, config, experts: dict, reference: dict) -> None:
    """Qwen2MoeModel: experts.{e}.{gate,up,down}_proj of a layer as one [E, ...] stack each
    (ffn_{gate,up,down}_exps); each expert's reference is its slice of the stored stack."""
    import torch

    by_stack: dict[tuple[str, str], list[str]] = {}
    for name in experts:  # model.layers.L.mlp.experts.E.P_proj.weight
        parts = name.split(".")
        by_stack.setdefault((parts[2], parts[6].split("_")[0]), []).append(name)
    for (layer, proj), names in by_stack.items():
        names.sort(key=lambda n: int(n.split(".")[5]))
        stack = np.stack([experts[n].numpy() for n in names])
        data, qtype, values = _stored(f"blk.{layer}.ffn_{proj}_exps.weight", stack)
        w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", data, raw_dtype=qtype)
        for name, value in zip(names, np.asarray(values, dtype=np.float32)):
            reference[name] = torch.from_numpy(np.ascontiguousarray(value))


def write_hybrid_gguf(arch: str, hf_path: str, out_path: str, reference_dir: str,
                      mtp_block: bool = False) -> str:
    """`hf_path` as llama.cpp would convert it to `out_path`; `reference_dir`: an HF checkpoint
    of the values the file holds. mtp_block (Qwen3.5): one MTP block after the layers, as
    _Qwen35MtpMixin writes it (block_count + 1, nextn_predict_layers 1, blk.N.nextn.*)."""
    import gguf
    import safetensors.torch as st
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_path)
    # the checkpoint's own names, as the converter reads them (not transformers' modules')
    state = st.load_file(os.path.join(hf_path, "model.safetensors"))
    model_arch = getattr(gguf.MODEL_ARCH, ARCH[arch])
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    w = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[model_arch])
    w.add_name(os.path.basename(hf_path))
    _metadata(w, arch, config)
    if mtp_block:
        n = config.num_hidden_layers
        w.add_block_count(n + 1)  # overwrites the layers' count, as the mixin's does
        w.add_nextn_predict_layers(1)
        rng = np.random.default_rng(0)
        for name, shape in ((f"blk.{n}.nextn.eh_proj.weight", (config.hidden_size,
                                                                2 * config.hidden_size)),
                            (f"blk.{n}.attn_norm.weight", (config.hidden_size,))):
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    reference, experts = {}, {}
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if ".mlp.experts." in hf_name:  # Qwen2MoeModel merges them per layer: below
            experts[hf_name] = tensor.float()
            continue
        pieces = []  # the values as the file holds them, per tensor the converter wrote
        for gguf_name, a in _converted(arch, config, names, hf_name, tensor.float()):
            rows, cols = _stored_order(arch, config, hf_name, a)
            stored = a.numpy()[rows] if cols is None else a.numpy()[rows][:, cols]
            data, qtype, values = _stored(gguf_name, stored)
            w.add_tensor(gguf_name, data, raw_dtype=qtype)
            values = np.asarray(values, dtype=np.float32)[np.argsort(rows)]
            pieces.append(values if cols is None else values[:, np.argsort(cols)])
        # gate and up halves back on the axis they were split from (the second to last);
        # in_proj_qkvz's rows back from where the converter's split put them
        values = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=-2)
        if hf_name.endswith("in_proj_qkvz.weight"):
            index = torch.arange(tensor.shape[0], dtype=torch.float64)[:, None]
            moved = torch.cat(_split_qkvz(config, index)).reshape(-1).long().numpy()
            values = values[np.argsort(moved)]
        if hf_name.endswith(".A_log"):
            values = np.log(-values)
        elif arch in QWEN and hf_name.endswith("norm.weight") and "linear_attn" not in hf_name:
            values = values - np.float32(1)
        reference[hf_name] = torch.from_numpy(
            np.ascontiguousarray(values.reshape(tuple(tensor.shape))))
    _write_expert_stacks(w, config, experts, reference)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.makedirs(reference_dir, exist_ok=True)
    shutil.copy(os.path.join(hf_path, "config.json"), reference_dir)
    st.save_file(reference, os.path.join(reference_dir, "model.safetensors"),
                 metadata={"format": "pt"})
    return out_path
