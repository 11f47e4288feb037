"""GGUF tensors as (HF name, tensor) pairs: llama.cpp's names mapped to transformers', q/k rows
un-permuted where llama.cpp's converter permuted them, and each quantized weight either
dequantized to float32 (`--load-format gguf_dequantize`, and what w8a8_int8 re-quantizes) or
kept in its blocks as a `PackedRows` (`--quantization gguf`: runner/quant/gguf_linear.py
multiplies them packed; an expert stack as one PackedRows per expert, rows of one copy).

Kept quantized, a 2-D tensor of a type the packed matmul has no kernel for
(runner/cpu/gguf_matmul.py SUPPORTED: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is
dequantized at
load and logged once per type, rather than the whole file refused: a Q3_K_M file still
serves, its unsupported tensors in float (what llama.cpp users expect: the file loads).
Float tensors (F32 / F16 / BF16: norms, and the odd float weight) are yielded as float.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Iterator

import numpy as np
import torch
from tqdm import tqdm

from kvstrata.runner.models.gguf_names import FAMILY_BLOCKS, LLAMA_BLOCK, RECOMPUTED, ROW_VECTORS
from kvstrata.runner.quant.mxfp4 import dequantize_ggml_mxfp4
from kvstrata.runner.quant.packed_rows import PackedRows

logger = logging.getLogger(__name__)

_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
_GGUF_BLOCK = LLAMA_BLOCK
# llama.cpp's gemma2 / gemma3 block tensors (gguf.MODEL_TENSORS): four norms a layer, so
# ffn_norm is the pre-feedforward norm there; the rest is named as in llama.
_GGUF_GEMMA_BLOCK = {**_GGUF_BLOCK, "ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
# llama.cpp's gpt-oss block tensors (convert_hf_to_gguf.py GptOssModel): biases on q/k/v/o,
# the router and the experts; the experts as [E, out, in] stacks, gate and up apart (a newer
# converter's --fuse-gate-up-exps: one ffn_gate_up_exps, gate rows then up rows). Their names
# here are gpt_oss.py's GGUF-layout ones (transformers' fused, interleaved gate_up_proj is
# another layout).
_GGUF_GPT_OSS_BLOCK = {
    **{k: v for k, v in _GGUF_BLOCK.items() if not k.startswith("ffn_")},
    "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "ffn_down_exps": "mlp.experts.down_proj"}
# HF parameters named without a .weight suffix (the converter appends one to the sinks)
_BARE_PARAMS = {"self_attn.sinks", "mlp.gate.e_score_correction_bias"}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_BLOCK_INDEX_RE = re.compile(r"^blk\.(\d+)\.")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from HF's "two halves" rotary layout to
    # interleaved pairs: rows (head, half, i) -> (head, i, half). Undo it. Rows only: the same
    # reorder applies to float rows and to rows of quantized blocks alike.
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(data: np.ndarray, tensor_type: Any) -> np.ndarray:
    """gguf's dequantisation, with Q4_1 and Q8_0 (SmolLM2's file: all its quantized tensors)
    done over the whole tensor at once: gguf's generic path walks row groups in Python
    (~2 s of a SmolLM2 load); tests/kv/test_gguf_index.py checks both equal gguf's. MXFP4
    (gpt-oss' experts): quant/mxfp4.py, bit for bit as gguf's (test_gpt_oss_gguf.py), its
    temporaries bounded to 4096 rows; 1.2x gguf's speed on an 8-expert 2880 x 2880 stack."""
    import gguf

    if tensor_type == gguf.GGMLQuantizationType.MXFP4 and data.dtype == np.uint8:
        return dequantize_ggml_mxfp4(data)
    if tensor_type == gguf.GGMLQuantizationType.Q4_1 and data.dtype == np.uint8:
        return _dequantize_q4_1(data)
    if tensor_type == gguf.GGMLQuantizationType.Q8_0 and data.dtype == np.uint8:
        return _dequantize_q8_0(data)
    return gguf.quants.dequantize(data, tensor_type)


def _dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """ggml's block_q8_0: fp16 scale d, 32 int8 values q: x = q * d."""
    rows = data.shape[:-1]
    blocks = np.ascontiguousarray(data).reshape(-1, 2 + Q4_1_BLOCK)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    values = blocks[:, 2:].view(np.int8).astype(np.float32) * d
    return values.reshape(*rows, data.shape[-1] // (2 + Q4_1_BLOCK) * Q4_1_BLOCK)


Q4_1_BLOCK = 32  # values per block: fp16 scale d, fp16 minimum m, 16 bytes of nibbles
Q4_1_BLOCK_BYTES = 2 + 2 + Q4_1_BLOCK // 2


def _dequantize_q4_1(data: np.ndarray) -> np.ndarray:
    """ggml's block_q4_1: x[j] = (qs[j] & 15) * d + m, x[j + 16] = (qs[j] >> 4) * d + m."""
    rows = data.shape[:-1]
    blocks = np.ascontiguousarray(data).reshape(-1, Q4_1_BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    values = q * d + m
    return values.reshape(*rows, data.shape[-1] // Q4_1_BLOCK_BYTES * Q4_1_BLOCK)


def hf_name(gguf_name: str, block: dict[str, str]) -> str | None:
    """transformers' name of a llama.cpp tensor (with `{e}` for each expert of a stack:
    gguf_names.py); None for one that is recomputed (rope factors), ValueError for one
    nothing maps."""
    m = _GGUF_BLOCK_RE.match(gguf_name)
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name]
    if m and m.group(2) in block:
        param = f"model.layers.{m.group(1)}.{block[m.group(2)]}"
        return param if block[m.group(2)] in _BARE_PARAMS else f"{param}.{m.group(3)}"
    if gguf_name in RECOMPUTED:
        return None  # rope factors, recomputed from the config's rope parameters
    raise ValueError(f"GGUF tensor {gguf_name!r} has no mapping")


def _join_kv_b(name: str, w: np.ndarray, waiting: dict) -> tuple[str, np.ndarray | None]:
    """DeepSeek's kv_b_proj [heads * (nope + v), kv_lora] from the converter's split of it:
    attn_k_b [heads, kv_lora, nope] (each head's k rows transposed) and attn_v_b
    [heads, v, kv_lora]; (name, None) until both halves of the layer are in."""
    base, half = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
    waiting[f"{base}.{half}"] = w
    k, v = waiting.get(f"{base}.k"), waiting.get(f"{base}.v")
    if k is None or v is None:
        return name, None
    del waiting[f"{base}.k"], waiting[f"{base}.v"]
    joined = np.concatenate([k.transpose(0, 2, 1), v], axis=1)
    return f"{base}.weight", joined.reshape(-1, joined.shape[-1])


def iter_gguf(gguf_path: str, config: Any, permute_qk: bool, keep_quantized: bool = False
              ) -> Iterator[tuple[str, "torch.Tensor | PackedRows"]]:
    """(HF name, float32 tensor or PackedRows) of every tensor of the file, in file order."""
    import gguf

    from kvstrata.runner.cpu import gguf_matmul
    from kvstrata.runner.models.gguf_index import read_gguf_tensors

    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    model_type = getattr(config, "model_type", None)
    block = _GGUF_GEMMA_BLOCK if model_type in ("gemma2", "gemma3_text") else \
        _GGUF_GPT_OSS_BLOCK if model_type == "gpt_oss" else \
        FAMILY_BLOCKS.get(model_type, _GGUF_BLOCK)
    nextn = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    dequantized: dict[str, int] = {}  # kept quantized, yet no kernel: type -> tensors
    kv_b_halves: dict[str, np.ndarray] = {}  # MLA: attn_k_b / attn_v_b waiting for the other
    for t in tqdm(read_gguf_tensors(gguf_path), desc="Loading GGUF", unit="tensor",
                  leave=False):
        layer = _BLOCK_INDEX_RE.match(t.name)
        if layer and 0 <= int(layer.group(1)) - config.num_hidden_layers < nextn:
            continue  # GLM-4.5's NextN block past the model's (not run, as transformers)
        name = hf_name(t.name, block)
        if name is None:
            continue
        qk = t.name.rsplit(".", 2)[-2] if permute_qk and t.name.startswith("blk.") else ""
        heads = {"attn_q": n_head, "attn_k": n_kv}.get(qk)
        # blocks of more than one value: a quantized type (F32 / F16 / BF16 hold one each);
        # a matrix, or an expert stack [experts, out, in] (kept packed expert by expert)
        packed = (keep_quantized and (t.data.ndim == 2 or (t.data.ndim == 3 and "{e}" in name))
                  and gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.tensor_type)][0] > 1)
        if packed and gguf_matmul.supported(t.tensor_type):
            raw = t.data if heads is None else unpermute_qk(t.data, heads)
            # np.array copies: the rows outlive the file's mapping (and may be reordered).
            rows = torch.from_numpy(np.array(raw))
            for expert_name, expert_rows in (
                    [(name, rows)] if rows.dim() == 2 else  # each expert: a view of the copy
                    [(name.format(e=e), rows[e]) for e in range(rows.shape[0])]):
                yield expert_name, PackedRows(int(t.tensor_type), expert_rows, int(t.shape[0]))
            continue
        if packed:
            kind = gguf.GGMLQuantizationType(t.tensor_type).name
            dequantized[kind] = dequantized.get(kind, 0) + 1
        w = dequantize(t.data, t.tensor_type)
        if heads is not None:
            w = unpermute_qk(w, heads)
        if "{e}" in name:  # an expert stack [experts, out, in]: each expert by its own name
            for e in range(w.shape[0]):
                yield name.format(e=e), torch.from_numpy(np.array(w[e], copy=True))
            continue
        if name.endswith(ROW_VECTORS) and w.ndim == 1:
            w = w[None]
        if name.endswith((".kv_b_proj.k.weight", ".kv_b_proj.v.weight")):
            name, w = _join_kv_b(name, w, kv_b_halves)
            if w is None:
                continue
        # np.array copies: dequantize may return a read-only view of the memory-mapped file.
        yield name, torch.from_numpy(np.array(w, copy=True))
    for kind, n in dequantized.items():
        logger.warning("GGUF %s: %d tensors of type %s have no packed kernel (built: %s); "
                       "they were dequantized to float at load", gguf_path, n, kind,
                       ", ".join(sorted(gguf.GGMLQuantizationType(q).name
                                        for q in gguf_matmul.SUPPORTED)))


__all__ = ["Q4_1_BLOCK_BYTES", "dequantize", "hf_name", "iter_gguf", "unpermute_qk"]
