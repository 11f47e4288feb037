"""A tiny random llama / qwen3 model written as a quantized GGUF file the way llama.cpp's
converter and llama-quantize write one (its tensor names, q/k rows permuted for llama, a
sentencepiece vocabulary), each tensor in the type `TYPES` gives it: a mix like a Q4_K_M
file's (attn_v / ffn_down in Q6_K, the rest Q4_K) in layer 0, and Q4_0 / Q4_1 / Q8_0 / Q5_K /
F32 segments side by side in layer 1's fused q|k|v and gate|up.

gguf's Python quantizer writes Q4_0 / Q4_1 / Q8_0 / Q5_0; it has no K-quant quantizer, so
those tensors are random blocks (any bytes are a valid block) with their fp16 scales set to
sizes that give weights of about the model's initializer range. The returned reference
weights are the file's values read back by gguf's own dequantizer, q/k rows put back in
transformers' order by this file's inverse of llama.cpp's permutation: what transformers then
runs as the float model.
"""
from __future__ import annotations

import numpy as np

from helpers.gemma_gguf import _vocab

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 300
# transformers' GGUF config conversion gives qwen3 its default head_dim (128), whatever the
# file's key_length says (real Qwen3 files have 128)
HEAD_DIM = {"llama": 64, "qwen3": 128}
ARCHS = ("llama", "qwen3")
# per HF weight suffix, per layer (else the default): the GGML type name
TYPES = {
    0: {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K",
        "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K"},
    1: {"q_proj": "Q4_0", "k_proj": "F32", "v_proj": "Q8_0", "o_proj": "Q4_1",
        "gate_proj": "Q5_K", "up_proj": "Q5_K", "down_proj": "Q8_0"},
    "embed": "Q4_0", "lm_head": "Q6_K",
}
# K-quant block layouts (ggml-common.h): byte offset of the fp16 d (and dmin), and d's size
_K_SCALES = {"Q4_K": ((0, 2), 3e-4), "Q5_K": ((0, 2), 1.5e-4), "Q6_K": ((208,), 6e-5),
             "Q3_K": ((108,), 3e-4)}


def tiny_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                  num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  head_dim=HEAD_DIM[arch], max_position_embeddings=512, initializer_range=0.05,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":  # tied, as SmolLM2: the file has no output.weight
        return tf.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
    return tf.Qwen3Config(**common, tie_word_embeddings=False, rope_theta=1e6)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from transformers' two
    halves to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2
                                                                                 ).reshape(w.shape)


def quantize_rows(w: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """(what add_tensor takes, its GGML type) for float32 w [rows, cols]: gguf's quantizer,
    or for a K-quant (which it lacks) random blocks of about the model's weight size."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return w.astype(np.float32), qtype
    if kind not in _K_SCALES:
        return gguf.quants.quantize(w.astype(np.float32), qtype), qtype
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
    offsets, scale = _K_SCALES[kind]
    for off in offsets:  # finite, small fp16 scales (random bytes could be inf / NaN)
        d = rng.uniform(0.5, 1.5, size=raw.shape[:2]).astype(np.float16) * np.float16(scale)
        raw[:, :, off:off + 2] = d[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(w.shape[0], -1), qtype


def add_sentencepiece_vocab(w, n: int) -> None:
    """A sentencepiece ("llama") vocabulary of n tokens; pad 0, bos 1, eos 2, unk 3."""
    tokens, scores, token_types = _vocab(n)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(token_types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)


def write_decoder_gguf(arch: str, out_path: str, seed: int = 7, types: dict | None = None
                       ) -> tuple:
    """Writes the file; returns (HF config, {HF name: float32 tensor the file holds}).
    `types`: TYPES' layout with other types (default TYPES)."""
    types = types or TYPES
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    torch.manual_seed(seed)
    state = AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict()
    rng = np.random.default_rng(seed)
    model_arch = getattr(gguf.MODEL_ARCH, arch.upper())
    w = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[model_arch])
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM[arch])
    w.add_value_length(HEAD_DIM[arch])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    add_sentencepiece_vocab(w, VOCAB)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    reference = {}
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.numpy()
        proj = base.rsplit(".", 1)[-1]
        heads = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(proj) if arch == "llama" else None
        order = np.arange(data.shape[0])
        if heads is not None:  # the rows llama.cpp's converter reorders
            order = llama_cpp_permute(order, heads)
            data = data[order]
        if data.ndim == 2:
            if proj in ("embed_tokens", "lm_head"):
                kind = types["embed" if proj == "embed_tokens" else "lm_head"]
            else:
                kind = types[int(hf_name.split(".")[2])][proj]
            stored, qtype = quantize_rows(data, kind, rng)
            w.add_tensor(f"{names.get_name(base)}.{suffix}", stored, raw_dtype=qtype)
            values = gguf.quants.dequantize(stored, qtype).reshape(data.shape)
        else:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", data.astype(np.float32))
            values = data
        inverse = np.argsort(order)
        reference[hf_name] = torch.from_numpy(np.ascontiguousarray(values[inverse],
                                                                   dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config, reference


def transformers_model(config, reference: dict):
    """transformers' float model holding the file's dequantized weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(reference, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model
