"""Weight loading: HF safetensors (single or sharded) and GGUF (dequantized).

Both sources yield (HF parameter name, tensor) pairs; the model copies each into its own
(fused) parameters, and we check every expected parameter was filled.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Iterator

import numpy as np
import torch
from tqdm import tqdm

from kvstrata.config.model_source import ModelSource
from kvstrata.runner.models.decoder import DecoderForCausalLM
from kvstrata.runner.models.deepseek import DeepseekForCausalLM
from kvstrata.runner.models.gemma import GemmaForCausalLM
from kvstrata.runner.models.gpt_oss import GptOssForCausalLM
from kvstrata.runner.models.hybrids import HYBRID_FAMILIES, hybrid_model
from kvstrata.runner.models.moe_decoder import MoeDecoderForCausalLM
from kvstrata.runner.models.registry import arch_spec
from kvstrata.runner.models.sandwich import SandwichForCausalLM

_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
_GGUF_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
# llama.cpp's gemma2 / gemma3 block tensors (gguf.MODEL_TENSORS): four norms a layer, so
# ffn_norm is the pre-feedforward norm there; the rest is named as in llama.
_GGUF_GEMMA_BLOCK = {**_GGUF_BLOCK, "ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, config: Any, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (fast and exact there); on accelerators the checkpoint's half
    dtype, or bfloat16 for float32/GGUF checkpoints (same range as float32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype != "auto":
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if ckpt in (torch.float16, "float16"):
        return torch.float16
    return torch.bfloat16


# What a model reads of one tensor (`read_spec(name)`, tensor-parallel ranks): None = skip it,
# "all", or ("rows" | "cols", lo, hi) = a slice of its first or second dimension.
ReadSpec = Any


def apply_read_spec(t: torch.Tensor, spec: ReadSpec) -> torch.Tensor:
    """The same slice taken of a tensor already in memory (GGUF, .bin)."""
    if spec == "all":
        return t
    kind, lo, hi = spec
    return t[lo:hi] if kind == "rows" else t[:, lo:hi]


def _read(h, key: str, spec: ReadSpec) -> torch.Tensor:
    """Read only the slice from the safetensors file (lazy: the rest is never touched)."""
    if spec == "all":
        return h.get_tensor(key)
    kind, lo, hi = spec
    sl = h.get_slice(key)
    return sl[lo:hi] if kind == "rows" else sl[:, lo:hi]


def _iter_safetensors(path: str, read_spec=None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {path}")
    names = []
    for file in files:
        h = safe_open(os.path.join(path, file), framework="pt")
        names.extend((h, k) for k in h.keys())
    for h, k in tqdm(names, desc="Loading safetensors", unit="tensor", leave=False):
        spec = "all" if read_spec is None else read_spec(k)
        if spec is not None:
            yield k, _read(h, k, spec)


def iter_checkpoint(source: ModelSource, config: Any, permute_qk: bool = False,
                    read_spec=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight: GGUF, safetensors, or (EAGLE heads are often
    published so) a single pytorch_model.bin, read with weights_only. `read_spec(name)`: only
    that part of each tensor (safetensors reads nothing else; the others slice in memory)."""
    if source.kind == "gguf":
        it = _iter_gguf(source.gguf_path, config, permute_qk)
    else:
        bin_path = os.path.join(source.path, "pytorch_model.bin")
        if not (os.path.isfile(bin_path) and not any(f.endswith(".safetensors")
                                                      for f in os.listdir(source.path))):
            return _iter_safetensors(source.path, read_spec)
        it = iter(torch.load(bin_path, map_location="cpu", weights_only=True,
                             mmap=True).items())
    if read_spec is None:
        return it
    return ((k, apply_read_spec(t, read_spec(k))) for k, t in it if read_spec(k) is not None)


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from HF's "two halves" rotary layout to
    # interleaved pairs: rows (head, half, i) -> (head, i, half). Undo it.
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(data: np.ndarray, tensor_type: Any) -> np.ndarray:
    """gguf's dequantisation, with Q4_1 and Q8_0 (SmolLM2's file: all its quantized tensors)
    done over the whole tensor at once: gguf's generic path walks row groups in Python
    (~2 s of a SmolLM2 load); tests/kv/test_gguf_index.py checks both equal gguf's."""
    import gguf

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


def _iter_gguf(gguf_path: str, config: Any, permute_qk: bool
               ) -> Iterator[tuple[str, torch.Tensor]]:
    from kvstrata.runner.models.gguf_index import read_gguf_tensors

    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    block = _GGUF_GEMMA_BLOCK if getattr(config, "model_type", None) in (
        "gemma2", "gemma3_text") else _GGUF_BLOCK
    for t in tqdm(read_gguf_tensors(gguf_path), desc="Loading GGUF", unit="tensor",
                  leave=False):
        m = _GGUF_BLOCK_RE.match(t.name)
        if t.name in _GGUF_GLOBAL:
            name = _GGUF_GLOBAL[t.name]
        elif m and m.group(2) in block:
            name = f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
        else:
            if t.name == "rope_freqs.weight":
                continue  # llama3 rope factors, recomputed from the config's rope_scaling
            raise ValueError(f"GGUF tensor {t.name!r} has no mapping")
        w = dequantize(t.data, t.tensor_type)
        if permute_qk and m and m.group(2) in ("attn_q", "attn_k"):
            w = _unpermute_qk(w, n_head if m.group(2) == "attn_q" else n_kv)
        # np.array copies: dequantize may return a read-only view of the memory-mapped file.
        yield name, torch.from_numpy(np.array(w, copy=True))


def load_model(source: ModelSource, config: Any, dtype: str | torch.dtype = "auto",
               device: torch.device | str = "cpu"
               ) -> DecoderForCausalLM | DeepseekForCausalLM:
    device = torch.device(device)
    name, spec = arch_spec(config)
    torch_dtype = resolve_dtype(dtype, config, device)
    if spec.family == "deepseek":
        if source.kind == "gguf":
            raise ValueError(f"{name}: GGUF checkpoints are not supported (HF safetensors only)")
        with open(os.path.join(source.path, "config.json"), encoding="utf-8") as fh:
            raw_config = json.load(fh)  # the fields as written, to refuse unknown ones
        model = DeepseekForCausalLM(config, raw_config, torch_dtype, device)
    elif spec.family == "gpt_oss":
        if source.kind == "gguf":
            raise ValueError(f"{name}: GGUF checkpoints are not supported yet (HF safetensors "
                             f"only)")
        model = GptOssForCausalLM(config, spec, torch_dtype, device)
    elif spec.family in HYBRID_FAMILIES:
        if source.kind == "gguf":
            raise ValueError(f"{name}: GGUF checkpoints are not supported (HF safetensors "
                             f"only)")
        model = hybrid_model(name, config, torch_dtype, device)
    elif spec.family == "moe":
        if source.kind == "gguf":
            raise ValueError(f"{name}: GGUF checkpoints are not supported yet (HF safetensors "
                             f"only)")
        model = MoeDecoderForCausalLM(config, spec, torch_dtype, device)
    elif spec.family == "gemma":
        model = GemmaForCausalLM(config, spec, torch_dtype, device)
        # llama.cpp's converter stores Gemma's norm weights as the scale 1 + w itself.
        model.norms_hold_scale = source.kind == "gguf"
    elif spec.family in ("olmo2", "glm4"):
        if source.kind == "gguf":
            raise ValueError(f"{name}: GGUF checkpoints are not supported (HF safetensors "
                             f"only)")
        model = SandwichForCausalLM(config, spec, torch_dtype, device)
    else:
        act = getattr(config, "hidden_act", None) or "silu"
        if act != "silu":  # the llama decoder's MLP is silu(gate) * up
            raise ValueError(f"{name}: hidden_act {act!r} is not supported (silu only)")
        model = DecoderForCausalLM(config, spec, torch_dtype, device)
    return fill_weights(model, source, config, spec.gguf_permute_qk)


def fill_weights(model, source: ModelSource, config: Any, permute_qk: bool = False,
                 what: str = ""):
    """Every checkpoint tensor into `model` (its load_weight maps, fuses, slices, or returns []
    for what is not its own: a draft head's share of a checkpoint), then the "every expected
    weight exactly once" check, then the model's `finish_load(loaded)` if it has one.
    `what` names the model in errors ("EAGLE head ", "MTP layer of ")."""
    weights = iter_checkpoint(source, config, permute_qk, getattr(model, "read_spec", None))
    where = f"{what}{source.display_name}"
    loaded: list[str] = []
    for name, tensor in weights:
        try:
            loaded.extend(model.load_weight(name, tensor))
        except KeyError as e:
            raise ValueError(f"unexpected weight {name!r} in {where}: {e}") from None
    expected = model.expected_keys()
    missing = expected - set(loaded)
    if source.kind == "gguf" and missing == {"lm_head"}:
        # llama.cpp uses token_embd as the output matrix when a GGUF has no output.weight,
        # whatever the derived config says about tying.
        model.lm_head = model.embed
        missing = set()
    if missing:
        raise ValueError(f"{where}: missing weights {sorted(missing)[:8]}")
    if len(loaded) != len(set(loaded)):
        raise ValueError(f"{where}: some weights appear more than once")
    if hasattr(model, "finish_load"):
        model.finish_load(loaded)
    return model.eval()
