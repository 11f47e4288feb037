"""A tiny Nemotron-H MoE or Falcon-H1 HF checkpoint (tests/helpers/hybrid_ckpt.py) written as a
GGUF file the way llama.cpp's convert_hf_to_gguf.py writes one (NemotronHModel with experts,
arch nemotron_h_moe; FalconH1Model, arch falcon-h1) with `--outtype q8_0`, with gguf's own
writer, name map and quantizer (the other hybrids: tests/helpers/hybrid_gguf.py, whose tensor
typing this shares):

  - Nemotron-H MoE: the Mamba2 transforms (-exp(A_log) as (heads, 1), D as (heads, 1), conv1d
    squeezed, the gated norm as (groups, d_inner / groups), dt_bias as ssm_dt.bias), the
    attention's q / k rows permuted (GraniteHybridModel's LlamaModel path), the experts'
    up / down stacked [E, ...] (ffn_up_exps / ffn_down_exps), the correction bias as
    exp_probs_b.bias; metadata: feed_forward_length per layer (the expert width at MoE
    layers, 0 elsewhere), head_count_kv per layer, the expert_* keys the converter sets
    (count, used count, widths, shared count, weights norm / scale, group count);
  - Falcon-H1: every muP multiplier folded into the weights as FalconH1Model.modify_tensors
    does (fold_falcon_multipliers), the Mamba2 transforms, pre_ff_layernorm as the suffix-less
    blk.N.ffn_norm (llama.cpp's name for it), no q / k permutation; metadata: the Mamba2 keys,
    head counts, key / value length, feed_forward_length, rope.freq_base, context_length.
`reference_dir` gets an HF checkpoint of the values the file holds, each transform undone by
this file's own inverse (Falcon-H1's: its config with every multiplier 1, the weights left
folded, as llama.cpp runs the file).
"""
from __future__ import annotations

import json
import os

import numpy as np

from helpers.decoder_gguf import llama_cpp_permute
from helpers.gemma_gguf import add_text_model_params
from helpers.hybrid_gguf import _source_name, _stored, ssm_metadata

UNIT_MULTIPLIERS = {"embedding_multiplier": 1.0, "lm_head_multiplier": 1.0,
                    "key_multiplier": 1.0, "attention_in_multiplier": 1.0,
                    "attention_out_multiplier": 1.0, "ssm_in_multiplier": 1.0,
                    "ssm_out_multiplier": 1.0, "ssm_multipliers": [1.0] * 5,
                    "mlp_multipliers": [1.0, 1.0]}


def fold_falcon_multipliers(config, state: dict) -> dict:
    """FalconH1Model.modify_tensors' folds, in torch as it does them: each multiplier into
    the weight it scales (the state dict's names)."""
    out = {}
    d_ssm, gs = config.mamba_d_ssm, config.mamba_n_groups * config.mamba_d_state
    z, x, b, c, dt = config.ssm_multipliers
    for name, t in state.items():
        t = t.float().clone()
        if "down_proj" in name:
            t = t * config.mlp_multipliers[1]
        elif "gate_proj" in name:
            t = t * config.mlp_multipliers[0]
        elif "k_proj" in name:
            t = t * config.key_multiplier * config.attention_in_multiplier
        elif "q_proj" in name or "v_proj" in name:
            t = t * config.attention_in_multiplier
        elif "o_proj" in name:
            t = t * config.attention_out_multiplier
        elif "out_proj" in name:
            t = t * config.ssm_out_multiplier
        elif "in_proj" in name:
            t = t * config.ssm_in_multiplier
            for (lo, hi), m in zip(((0, d_ssm), (d_ssm, 2 * d_ssm), (2 * d_ssm, 2 * d_ssm + gs),
                                    (2 * d_ssm + gs, 2 * d_ssm + 2 * gs),
                                    (2 * d_ssm + 2 * gs, t.shape[0])), (z, x, b, c, dt)):
                t[lo:hi] *= m
        elif "lm_head" in name:
            t = t * config.lm_head_multiplier
        elif "embed_tokens" in name:
            t = t * config.embedding_multiplier
        out[name] = t
    return out


def _nemotron_moe_metadata(w, config) -> None:
    kinds = config.layers_block_type
    w.add_context_length(2 ** 20)
    w.add_feed_forward_length([config.moe_intermediate_size if k == "moe" else 0
                               for k in kinds])
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv([config.num_key_value_heads if k == "full_attention" else 0
                         for k in kinds])
    w.add_vocab_size(config.vocab_size)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_scaling_finetuned(False)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(config.moe_shared_expert_intermediate_size)
    w.add_expert_count(config.n_routed_experts)
    w.add_expert_shared_count(config.n_shared_experts)
    w.add_expert_weights_norm(config.norm_topk_prob)
    w.add_expert_weights_scale(config.routed_scaling_factor)
    w.add_expert_group_count(config.n_group)
    ssm_metadata(w, config, config.mamba_num_heads * config.mamba_head_dim,
                 config.mamba_num_heads, config.ssm_state_size, config.n_groups,
                 config.conv_kernel, config.layer_norm_epsilon, rms_key=False)


def _falcon_metadata(w, config) -> None:
    """FalconH1Model.set_gguf_parameters: the text model's sizes over Mamba2Model's keys."""
    add_text_model_params(w, config)
    w.add_vocab_size(config.vocab_size)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    ssm_metadata(w, config, config.mamba_d_ssm, config.mamba_n_heads, config.mamba_d_state,
                 config.mamba_n_groups, config.mamba_d_conv, config.rms_norm_eps)


def _converted(arch: str, config, names, hf_name: str, a):
    """(llama.cpp's name, tensor as the converter stores it, its row order) for one tensor;
    Nemotron-H's per-expert / stacked experts are written by write_expert_stacks."""
    import torch

    if arch == "falcon_h1" and hf_name.endswith("pre_ff_layernorm.weight"):
        return f"blk.{hf_name.split('.')[2]}.ffn_norm", a, None  # FFN_PRE_NORM: no suffix
    if hf_name.endswith("e_score_correction_bias"):
        return f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias", a, None
    base, suffix = _source_name("nemotron_h" if arch != "falcon_h1" else arch, hf_name)
    mapped = names.get_name(base)
    assert mapped is not None, hf_name
    rows = None
    if hf_name.endswith(".A_log"):
        a = -torch.exp(a).reshape(-1, 1)
    elif hf_name.endswith(".D"):
        a = a.reshape(-1, 1)
    elif hf_name.endswith(("mixer.norm.weight", "mamba.norm.weight")):
        groups = config.mamba_n_groups if arch == "falcon_h1" else config.n_groups
        a = a.reshape(groups, -1)
    elif hf_name.endswith("conv1d.weight"):
        a = a.squeeze()
    elif arch != "falcon_h1" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = (config.num_attention_heads if "q_proj" in hf_name
                 else config.num_key_value_heads)
        rows = llama_cpp_permute(np.arange(a.shape[0]), heads)
    return mapped + suffix, a, rows


def _write(w, gguf_name: str, a: np.ndarray, rows) -> np.ndarray:
    """Write one tensor; the values the file holds, back in HF's row order."""
    stored = a if rows is None else a[rows]
    data, qtype, values = _stored(gguf_name, stored)
    w.add_tensor(gguf_name, data, raw_dtype=qtype)
    values = np.asarray(values, dtype=np.float32)
    return values if rows is None else values[np.argsort(rows)]


def _expert_stacks(state: dict) -> dict[tuple[str, str], list]:
    """(layer, up / down) -> its experts' tensors in order, from transformers' stacks
    (mixer.experts.up_proj [E, ...]) or per-expert names (mixer.experts.{e}.up_proj.weight)."""
    stacks: dict[tuple[str, str], list] = {}
    names = [n for n in state if "experts" in n.split(".")]
    for name in sorted(names, key=lambda n: [(int(p), "") if p.isdigit() else (-1, p)
                                             for p in n.split(".")]):
        parts = name.split(".")
        layer, proj = parts[2], [p for p in parts if p.endswith("_proj")][0]
        tensor = state[name].float()
        stacks.setdefault((layer, proj), []).extend(
            list(tensor) if tensor.dim() == 3 else [tensor])
    return stacks


def write_hybrid_gguf_extra(arch: str, hf_path: str, out_path: str, reference_dir: str) -> str:
    """`hf_path` (arch nemotron_h_moe or falcon_h1) as llama.cpp would convert it to
    `out_path`; `reference_dir`: an HF checkpoint of the values the file holds."""
    import gguf
    import safetensors.torch as st
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_path)
    state = st.load_file(os.path.join(hf_path, "model.safetensors"))
    model_arch = gguf.MODEL_ARCH.FALCON_H1 if arch == "falcon_h1" else \
        gguf.MODEL_ARCH.NEMOTRON_H_MOE
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    w = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[model_arch])
    w.add_name(os.path.basename(hf_path))
    config_json = json.load(open(os.path.join(hf_path, "config.json")))
    if arch == "falcon_h1":
        _falcon_metadata(w, config)
        state = fold_falcon_multipliers(config, state)
        config_json.update(UNIT_MULTIPLIERS)
    else:
        _nemotron_moe_metadata(w, config)
    reference = {}
    for (layer, proj), experts in _expert_stacks(state).items():
        stack = torch.stack(experts).numpy()
        values = _write(w, f"blk.{layer}.ffn_{proj.split('_')[0]}_exps.weight", stack, None)
        reference[f"model.layers.{layer}.mixer.experts.{proj}"] = torch.from_numpy(values)
    for hf_name, tensor in state.items():
        if "experts." in hf_name and "shared_experts" not in hf_name:
            continue
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name, a, rows = _converted(arch, config, names, hf_name, tensor.float())
        values = _write(w, gguf_name, a.numpy(), rows)
        if hf_name.endswith(".A_log"):
            values = np.log(-values)
        reference[hf_name] = torch.from_numpy(np.ascontiguousarray(
            values.reshape(tuple(tensor.shape))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.makedirs(reference_dir, exist_ok=True)
    with open(os.path.join(reference_dir, "config.json"), "w") as f:
        json.dump(config_json, f, indent=1)
    st.save_file(reference, os.path.join(reference_dir, "model.safetensors"),
                 metadata={"format": "pt"})
    return out_path
