"""A tiny gpt-oss HF checkpoint written as a GGUF file the way llama.cpp's convert_hf_to_gguf.py
writes one (class GptOssModel, --outtype f16) and llama-quantize's MXFP4_MOE leaves it, with
gguf's own writer and quantizer:
  - metadata: TextModel.set_gguf_parameters' keys (sizes, heads, key / value length, rms eps,
    rope base, YaRN type / factor / original context / betas, expert count / used count) plus
    GptOssModel's sliding window and expert feed-forward length; a "gpt2" (byte-level BPE)
    vocabulary with merges, the special ids and a chat template;
  - tensors: llama.cpp's names (gguf.get_tensor_name_map), the sinks as attn_sinks.weight;
    the experts transposed to [E, out, in] and their interleaved gate / up columns split into
    ffn_gate_exps / ffn_up_exps (or, `fuse_gate_up`, the newer converter's ffn_gate_up_exps:
    gate rows then up rows), their biases alike; 2-D weights F16 (the router F32, as the
    converter keeps ffn_gate_inp), 1-D tensors F32; the experts MXFP4 (gguf's quantizer) or
    `expert_type`.
What the file cannot say (the SwiGLU limit, YaRN's `truncate`) the checkpoint must have as
the reader assumes (config/gguf_gpt_oss.py): `gguf_compatible_overrides`.
"""
from __future__ import annotations

import glob
import os
import shutil

import numpy as np

from helpers.gemma_gguf import add_special_token_ids, add_text_model_params
from helpers.gpt_oss import VOCAB

# what a GGUF cannot carry, as llama.cpp fixes it; an expert width that is whole MXFP4 blocks
gguf_compatible_overrides = {"swiglu_limit": 7.0, "intermediate_size": 64}
SPECIALS = ["<|endoftext|>", "<|startoftext|>", "<|return|>", "<|start|>", "<|message|>",
            "<|end|>"]  # pad 0, bos 1, eos 2 (tests/helpers/gpt_oss.py's ids)
CHAT_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
                 "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant"
                 "{% endif %}")


def _byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable stand-in of each byte, in byte order."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the specials (CONTROL), the 256 bytes, then merges of
    letter pairs up to VOCAB tokens."""
    letters = "etaoinshrdlu"
    merges = [f"{a} {b}" for a in letters for b in letters][:VOCAB - len(SPECIALS) - 256]
    tokens = SPECIALS + _byte_chars() + [m.replace(" ", "") for m in merges]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, merges


def _metadata(w, config) -> None:
    import gguf

    rope = config.rope_parameters
    add_text_model_params(w, config)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_expert_count(config.num_local_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_sliding_window(config.sliding_window)
    w.add_expert_feed_forward_length(config.intermediate_size)
    tokens, types, merges = _vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    add_special_token_ids(w, config)
    w.add_chat_template(CHAT_TEMPLATE)


def _gate_up_parts(a: np.ndarray, fuse: bool) -> list[tuple[str, np.ndarray]]:
    """Rows (dim 1) interleaved gate / up -> ("gate_proj", even), ("up_proj", odd), or fused
    as ("gate_up_proj", gate then up)."""
    gate, up = a[:, ::2], a[:, 1::2]
    if fuse:
        return [("gate_up_proj", np.concatenate([gate, up], axis=1))]
    return [("gate_proj", gate), ("up_proj", up)]


def _gguf_tensors(state: dict, fuse_gate_up: bool):
    """(HF on-disk name, llama.cpp's name-to-be (HF-side), array) as the converter's
    modify_tensors yields them: experts [E, out, in], gate / up split (or fused)."""
    for name, t in state.items():
        a = t.float().numpy()
        base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        if name.endswith("gate_up_proj"):  # [E, 2I, H] once transposed, gate rows even
            for part, arr in _gate_up_parts(a.transpose(0, 2, 1), fuse_gate_up):
                yield name, name.replace("gate_up_proj", part), ".weight", arr
        elif name.endswith("gate_up_proj_bias"):
            for part, arr in _gate_up_parts(a, fuse_gate_up):
                yield name, name.replace("gate_up_proj_bias", part), ".bias", arr
        elif name.endswith("down_proj"):
            yield name, name, ".weight", a.transpose(0, 2, 1)  # [E, H, I]
        elif name.endswith("down_proj_bias"):
            yield name, name.replace("down_proj_bias", "down_proj"), ".bias", a
        else:
            yield name, base, name[len(base):] or ".weight", a  # sinks: ".weight" appended


def _stored(arr: np.ndarray, gguf_name: str, expert_type: str):
    """(data for add_tensor, raw GGML type or None, the values as stored)."""
    import gguf

    if "_exps.weight" in gguf_name and expert_type != "F16":
        qtype = gguf.GGMLQuantizationType[expert_type]
        data = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)
        return data, qtype, gguf.quants.dequantize(data, qtype).reshape(arr.shape)
    # the converter's prepare_tensors: what does not end in ".weight" (the 2-D expert
    # biases too) stays F32; llama.cpp's expert-bias add takes no F16 operand
    if arr.ndim >= 2 and "ffn_gate_inp" not in gguf_name and gguf_name.endswith(".weight"):
        data = np.ascontiguousarray(arr, dtype=np.float16)
        return data, None, data.astype(np.float32)
    data = np.ascontiguousarray(arr, dtype=np.float32)
    return data, None, data


def _undo(pieces: dict[str, np.ndarray], hf_name: str, like: np.ndarray) -> np.ndarray:
    """An HF on-disk tensor rebuilt from the stored values of its GGUF pieces."""
    out = np.empty_like(like)
    if hf_name.endswith("gate_up_proj") or hf_name.endswith("gate_up_proj_bias"):
        if len(pieces) == 1:  # fused: gate rows then up rows
            (fused,) = pieces.values()
            half = fused.shape[1] // 2
            gate, up = fused[:, :half], fused[:, half:]
        else:
            gate, up = (v for k, v in sorted(pieces.items()))  # gate_proj < up_proj
        if hf_name.endswith("gate_up_proj"):
            out[:, :, ::2], out[:, :, 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        else:
            out[:, ::2], out[:, 1::2] = gate, up
        return out
    (value,) = pieces.values()
    return value.transpose(0, 2, 1) if hf_name.endswith("down_proj") else value.reshape(
        like.shape)


def write_gpt_oss_gguf(hf_path: str, out_path: str, reference_dir: str | None = None,
                       expert_type: str = "MXFP4", fuse_gate_up: bool = False) -> str:
    """`hf_path` as llama.cpp would convert it to `out_path`; `reference_dir`: an HF checkpoint
    of the values the file holds (F16 rounding, gguf's dequantization of the experts)."""
    import gguf
    import safetensors.torch as st
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_path)
    state = st.load_file(glob.glob(os.path.join(hf_path, "*.safetensors"))[0])
    arch = gguf.MODEL_ARCH.GPT_OSS
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    w = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(os.path.basename(hf_path))
    _metadata(w, config)
    pieces: dict[str, dict[str, np.ndarray]] = {}
    for hf_name, base, suffix, arr in _gguf_tensors(state, fuse_gate_up):
        if base.endswith("gate_up_proj"):  # the newer converter's fused tensor
            name = base.replace("model.layers.", "blk.").replace(
                ".mlp.experts.gate_up_proj", ".ffn_gate_up_exps")
        else:
            name = names.get_name(base)
        assert name is not None, hf_name
        data, qtype, values = _stored(arr, name + suffix, expert_type)
        w.add_tensor(name + suffix, data, raw_dtype=qtype)
        pieces.setdefault(hf_name, {})[base] = values
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if reference_dir is not None:
        os.makedirs(reference_dir, exist_ok=True)
        shutil.copy(os.path.join(hf_path, "config.json"), reference_dir)
        ref = {k: torch.from_numpy(np.ascontiguousarray(_undo(pieces[k], k, v.float().numpy())))
               for k, v in state.items()}
        st.save_file(ref, os.path.join(reference_dir, "model.safetensors"),
                     metadata={"format": "pt"})
    return out_path
