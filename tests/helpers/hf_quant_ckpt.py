"""Quantized HF checkpoints written as their producers publish them (numpy, from the layouts).

GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K * bits / 32, N], value k of a word at bits
(k % per) * bits, packed along K; qzeros int32 [G, N * bits / 32] packed along N, stored
minus one in checkpoint_format gptq (v1); scales fp16 [G, N]; g_idx int32 [K].
AWQ (AutoAWQ GEMM): qweight int32 [K, N / 8], qzeros [G, N / 8], nibble i of a word holding
column [0, 2, 4, 6, 1, 3, 5, 7][i] of its 8; scales fp16 [G, N].
compressed-tensors pack-quantized: weight_packed int32 [N, K * bits / 32] of the codes
signed + 2^(bits-1) packed along K; weight_shape; weight_scale [N, G]; weight_zero_point
(asymmetric) signed, packed along N into int32 [N * bits / 32, G]; weight_g_idx [K].
FP8 block: weight e4m3 [N, K], weight_scale_inv float32 [N / bn, K / bk], w = weight * s.

Each packer is the producer's loop written out (not kvstrata's unpacker run backwards), and
`reference_dequant` is value = scale[n, g_idx[k]] * (q[n, k] - zero[n, g_idx[k]]).
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def act_order_g_idx(k: int, group: int, rng: np.random.Generator) -> np.ndarray:
    """GPTQ desc_act: columns visited in a permuted order, the i-th visited in group
    i // group (each group has `group` columns scattered over K)."""
    perm = rng.permutation(k)
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[perm] = np.arange(k) // group
    return g_idx


def quantize(w: np.ndarray, bits: int, group: int, sym: bool, g_idx: np.ndarray | None = None):
    """Round-to-nearest min-max quantization of w [N, K]: (codes [N, K] in 0..2^bits-1,
    scales fp16 [N, G], zeros int [N, G], g_idx [K])."""
    n, k = w.shape
    if g_idx is None:
        g_idx = (np.arange(k) // (k if group == -1 else group)).astype(np.int32)
    groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    scales = np.zeros((n, groups), np.float16)
    zeros = np.zeros((n, groups), np.int64)
    codes = np.zeros((n, k), np.int64)
    for g in range(groups):
        cols = np.nonzero(g_idx == g)[0]
        x = w[:, cols]
        if sym:
            s = np.maximum(np.abs(x).max(1), 1e-6) / ((maxq + 1) / 2 - 0.5)
            z = np.full(n, (maxq + 1) // 2)
        else:
            lo, hi = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
            s = np.maximum(hi - lo, 1e-6) / maxq
            z = np.clip(np.round(-lo / s), 0, maxq).astype(np.int64)
        s16 = s.astype(np.float16)
        scales[:, g], zeros[:, g] = s16, z
        codes[:, cols] = np.clip(np.round(x / s16.astype(np.float32)[:, None]) + z[:, None],
                                 0, maxq)
    return codes, scales, zeros, g_idx


def reference_dequant(codes, scales, zeros, g_idx) -> np.ndarray:
    s = scales.astype(np.float32)[:, g_idx]
    return (s * (codes - zeros[:, g_idx]).astype(np.float32)).astype(np.float32)


def _pack_rows_into_words(values: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ's loop: row `row` of the result ORs values[i .. i + per] shifted by
    bits * (j - i): packed along the first axis."""
    per = 32 // bits
    out = np.zeros((values.shape[0] // per, values.shape[1]), dtype=np.uint32)
    for row in range(out.shape[0]):
        for j in range(per):
            out[row] |= values[row * per + j].astype(np.uint32) << (bits * j)
    return out.view(np.int32)


def pack_gptq(codes, scales, zeros, g_idx, bits: int, v1: bool) -> dict:
    stored = (zeros - 1) & ((1 << bits) - 1) if v1 else zeros  # v1: the zero minus one
    return {"qweight": _pack_rows_into_words(codes.T, bits),             # [K/per, N]
            "qzeros": np.ascontiguousarray(_pack_rows_into_words(stored, bits).T),  # [G, N/per]
            "scales": np.ascontiguousarray(scales.T),                      # [G, N]
            "g_idx": g_idx.astype(np.int32)}


def pack_awq(codes, scales, zeros) -> dict:
    def pack(v: np.ndarray) -> np.ndarray:  # v [rows, N] -> [rows, N / 8]
        out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
        for col in range(out.shape[1]):
            for i in range(8):
                out[:, col] |= v[:, col * 8 + AWQ_PACK_ORDER[i]].astype(np.uint32) << (4 * i)
        return out.view(np.int32)

    return {"qweight": pack(codes.T), "qzeros": pack(np.ascontiguousarray(zeros.T)),
            "scales": np.ascontiguousarray(scales.T)}


def pack_compressed_tensors(codes, scales, zeros, g_idx, bits: int, sym: bool,
                            packed: bool, scale_dtype=torch.bfloat16, actorder: bool = False
                            ) -> dict:
    offset = 1 << (bits - 1)
    signed = codes - offset  # the int8 values compressed-tensors quantizes to
    out = {"weight_scale": torch.from_numpy(scales.astype(np.float32)).to(scale_dtype)}
    if packed:
        out["weight_packed"] = _pack_rows_into_words(
            (signed + offset).T, bits).T.copy()  # packed along K: [N, K / per]
        out["weight_shape"] = np.array(codes.shape, dtype=np.int32)
    else:
        out["weight"] = signed.astype(np.int8)
    if not sym:  # the signed zero point, packed along N like the weights' codes
        signed_zero = zeros - offset
        out["weight_zero_point"] = _pack_rows_into_words(signed_zero + offset, bits)
    if actorder:
        out["weight_g_idx"] = g_idx.astype(np.int32)
    return out


def fp8_block_quantize(w: np.ndarray, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's scheme: per block s = amax / 448, weight = e4m3(w / s), scale_inv = s."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    scale = np.zeros((gn, gk), np.float32)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(gn):
        for j in range(gk):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = max(float(np.abs(tile).max()), 1e-12) / 448.0
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = torch.from_numpy(tile / s).to(
                torch.float8_e4m3fn)
    return q, torch.from_numpy(scale)


def fp8_reference_dequant(q: torch.Tensor, scale: torch.Tensor, block) -> np.ndarray:
    """Blockwise loop: every element times its block's scale_inv."""
    w = q.float().numpy().copy()
    bn, bk = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= float(scale[i, j])
    return w


def write_quantized(float_dir: str, out_dir: str, quant_config: dict,
                    quantize_linear) -> str:
    """A copy of the float checkpoint in `float_dir` with every decoder linear replaced by
    `quantize_linear(w [N, K] float32) -> (parts {suffix: array}, dequantized [N, K])`, and
    `quant_config` as config.json's quantization_config. Returns `out_dir`; the float
    checkpoint holding the dequantized weights (transformers' reference) is out_dir + "-ref"."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out_dir, exist_ok=True)
    ref_dir = out_dir + "-ref"
    os.makedirs(ref_dir, exist_ok=True)
    files = [f for f in os.listdir(float_dir) if f.endswith(".safetensors")]
    tensors = {}
    for f in files:
        tensors.update(load_file(os.path.join(float_dir, f)))
    quant, ref = {}, {}
    for name, t in tensors.items():
        prefix = name[:-len(".weight")] if name.endswith(".weight") else None
        if prefix and any(prefix.endswith(lin) for lin in LINEARS):
            parts, deq = quantize_linear(t.float().numpy())
            for suffix, v in parts.items():
                quant[f"{prefix}.{suffix}"] = v if isinstance(v, torch.Tensor) else \
                    torch.from_numpy(np.ascontiguousarray(v))
            ref[name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
        else:
            quant[name] = ref[name] = t
    save_file(quant, os.path.join(out_dir, "model.safetensors"))
    save_file(ref, os.path.join(ref_dir, "model.safetensors"))
    for f in os.listdir(float_dir):
        if f.endswith(".json") and f != "model.safetensors.index.json":
            with open(os.path.join(float_dir, f)) as fh:
                body = json.load(fh)
            if f == "config.json":
                with open(os.path.join(ref_dir, f), "w") as fh:
                    json.dump(body, fh)
                body["quantization_config"] = quant_config
            with open(os.path.join(out_dir, f), "w") as fh:
                json.dump(body, fh)
            if f != "config.json":
                with open(os.path.join(ref_dir, f), "w") as fh:
                    json.dump(body, fh)
    return out_dir


# Every linear's input width a multiple of 128 (hidden 128, q heads 4 x 32, intermediate 256)
# so group sizes 32 / 64 / 128 all tile it; the conftest tiny models' 88-wide MLP would not.
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 128, 256, 4, 2, 32, 300


def float_checkpoint(arch: str, path: str, seed: int = 11) -> str:
    """A tiny random llama (tied embeddings) or qwen3 (q/k norms) in float32 safetensors."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                  num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  head_dim=HEAD_DIM, max_position_embeddings=512, initializer_range=0.1,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = (tf.LlamaConfig(**common, tie_word_embeddings=True) if arch == "llama" else
              tf.Qwen3Config(**common, tie_word_embeddings=False))
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        path, safe_serialization=True)
    return path
