"""The tensors of a Mamba2 or Nemotron-H GGUF file (llama.cpp archs `mamba2`, `nemotron_h`) as
the HF checkpoint's (name, float32 tensor), every transform of convert_hf_to_gguf.py
(Mamba2Model.modify_tensors, which Nemotron-H's Mamba2 layers run through GraniteHybridModel;
LlamaModel's q/k permutation on its attention layers) undone:

  llama.cpp tensor        as the converter stored it             HF parameter
  ssm_a                   -exp(A_log), shape (heads, 1)          mixer.A_log = log(-A), (heads,)
  ssm_d                   D, shape (heads, 1)                    mixer.D, (heads,)
  ssm_conv1d.weight       conv1d.weight squeezed: (C, K)         mixer.conv1d.weight, (C, 1, K)
  ssm_norm.weight         norm.weight as (groups, d_inner/groups) mixer.norm.weight, (d_inner,)
  ssm_dt.bias             dt_bias (renamed dt_proj.bias)         mixer.dt_bias
  attn_q / attn_k         rows permuted to rope's interleaved    mixer.q_proj / k_proj, rows
                          pairs (GraniteHybridModel.undo_permute, back in HF's order
                          set for Nemotron-H too: its attention
                          has no rope, llama.cpp ignores the order)
Names are `backbone.*`, as NVIDIA's and state-spaces' checkpoints spell them (nemotron_h.py
reads both). A_log comes back as log(-A): exp of it is A to within a float32 rounding, which
the model applies as -exp(A_log) like an HF checkpoint (an A with a value >= 0 is no
-exp(A_log) and is refused). Every tensor is dequantized to float32: the recurrent models
take float weights only (--quantization gguf is refused for them by the loader).
"""
from __future__ import annotations

import re
from typing import Any, Iterator

import numpy as np
import torch
from tqdm import tqdm

from kvstrata.runner.models.gguf_weights import dequantize, unpermute_qk

MODEL_TYPES = ("mamba2", "nemotron_h")
_GLOBAL = {"token_embd.weight": "backbone.embeddings.weight",
           "output_norm.weight": "backbone.norm_f.weight",
           "output.weight": "lm_head.weight"}
# llama.cpp block tensor -> the HF module under backbone.layers.N
_BLOCK = {"attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d",
          "ssm_norm": "mixer.norm", "ssm_out": "mixer.out_proj", "attn_q": "mixer.q_proj",
          "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj", "attn_output": "mixer.o_proj",
          "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj"}
# tensors the converter stores under other names or with no suffix -> the HF parameter
_BARE = {("ssm_a", None): "mixer.A_log", ("ssm_d", None): "mixer.D",
         ("ssm_dt", "bias"): "mixer.dt_bias"}
_NAME_RE = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?$")


def hf_name(gguf_name: str) -> tuple[str, str | None]:
    """(HF name, llama.cpp's short tensor kind or None for a global tensor); ValueError for
    a tensor nothing maps."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name], None
    m = _NAME_RE.match(gguf_name)
    if m:
        layer, kind, suffix = m.groups()
        if (kind, suffix) in _BARE:
            return f"backbone.layers.{layer}.{_BARE[kind, suffix]}", kind
        if kind in _BLOCK and suffix is not None:
            return f"backbone.layers.{layer}.{_BLOCK[kind]}.{suffix}", kind
    raise ValueError(f"GGUF tensor {gguf_name!r} has no mapping for a Mamba2 / Nemotron-H model")


def undo_converter(kind: str | None, w: np.ndarray, config: Any, gguf_name: str) -> np.ndarray:
    """The HF tensor from the converter's stored values (the table above)."""
    if kind == "ssm_a":
        if not (w < 0).all():
            raise ValueError(f"GGUF tensor {gguf_name!r} holds values >= 0: not the converter's "
                             f"-exp(A_log)")
        return np.log(-w).reshape(-1)
    if kind in ("ssm_d", "ssm_norm"):
        return w.reshape(-1)
    if kind == "ssm_conv1d" and gguf_name.endswith(".weight"):
        return w[:, None, :]
    if kind == "attn_q" and gguf_name.endswith(".weight"):
        return unpermute_qk(w, config.num_attention_heads)
    if kind == "attn_k" and gguf_name.endswith(".weight"):
        return unpermute_qk(w, config.num_key_value_heads)
    return w


def iter_hybrid_gguf(gguf_path: str, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) of every tensor of the file, in file order."""
    from kvstrata.runner.models.gguf_index import read_gguf_tensors

    for t in tqdm(read_gguf_tensors(gguf_path), desc="Loading GGUF", unit="tensor",
                  leave=False):
        name, kind = hf_name(t.name)
        w = undo_converter(kind, np.asarray(dequantize(t.data, t.tensor_type), np.float32),
                           config, t.name)
        # np.array copies: dequantize may return a read-only view of the memory-mapped file.
        yield name, torch.from_numpy(np.array(w, copy=True))


__all__ = ["MODEL_TYPES", "hf_name", "iter_hybrid_gguf", "undo_converter"]
