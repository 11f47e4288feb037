"""The tensors of a Mamba2, Nemotron-H (MoE too), Granite-4.0-H, Qwen3.5, Qwen3-Next or
Falcon-H1 GGUF file (llama.cpp archs `mamba2`, `nemotron_h`, `nemotron_h_moe`,
`granitehybrid`, `qwen35`, `qwen3next`, `falcon-h1`) as the HF checkpoint's (name, float32
tensor), every transform of convert_hf_to_gguf.py (Mamba2Model.modify_tensors, which the
hybrids' Mamba2 layers run through GraniteHybridModel; LlamaModel's q / k permutation on
their attention layers; GraniteMoeModel's split of input_linear; Qwen3NextModel's,
Qwen2MoeModel's expert stacks and, for Qwen3.5, _LinearAttentionVReorderBase's) undone:

  llama.cpp tensor        as the converter stored it             HF parameter
  ssm_a                   -exp(A_log), shape (heads, 1)          A_log = log(-A), (heads,)
  ssm_d                   D, shape (heads, 1)                    D, (heads,)
  ssm_conv1d.weight       conv1d.weight squeezed: (C, K)         conv1d.weight, (C, 1, K)
  ssm_norm.weight         norm.weight as (groups, d_inner/groups) norm.weight, (d_inner,)
  ssm_dt.bias             dt_bias (renamed dt_proj.bias)         dt_bias
  attn_q / attn_k         rows permuted to rope's interleaved    q_proj / k_proj, rows back in
                          pairs (GraniteHybridModel.undo_permute; HF's order
                          Nemotron-H has no rope, llama.cpp
                          ignores the order there)
  ffn_gate_exps + _up_    input_linear [E, 2I, H] split on I     block_sparse_moe.input_linear
  ffn_gate_shexp + _up_   input_linear [2S, H] split (plain      shared_mlp.input_linear
  (or ffn_gate + ffn_up)  ffn_gate / ffn_up without experts)
Qwen3.5 (attn_qkv / attn_gate / ssm_beta / ssm_alpha = in_proj_qkv / _z / _b / _a; rope is
NEOX-style there, q / k not permuted):
  *_norm but ssm_norm     the zero-centred norm's scale 1 + w     w (the model adds the 1 back
                                                                  at load, as for HF weights)
  V heads (value rows of  tiled by key head ([K0, K1, .., K0,     grouped ([G0 v0..v(r-1),
  attn_qkv, attn_gate,    K1, ..]) when value heads outnumber     G1 ..]) again
  ssm_beta / _alpha, ssm_a, key heads
  ssm_dt, conv1d; ssm_out's columns)
  ssm_a                   -exp(A_log), 1-D                        A_log = log(-A)
  blk.N.* past the layers the MTP block (nextn)                   not read (as mtp.*)
Qwen3.5-MoE (Qwen3_5MoeTextModel): Qwen3.5's names and transforms, Qwen3-Next's MoE tensors.
Qwen3-Next (Qwen3NextModel, no V reordering; norms as Qwen3.5's):
  attn_qkv + attn_gate    in_proj_qkvz ([q, k, v, z] per key     in_proj_qkvz, regrouped
                          head) split into [q, k, v] of all heads
                          and z
  ssm_ba                  in_proj_ba as is                       in_proj_ba
  ffn_{gate,up,down}_exps the experts stacked [E, ...]            experts.{e}.*_proj, each
  ffn_gate_inp(_shexp), ffn_*_shexp: the router, the shared expert's gate and projections
Nemotron-H MoE (NemotronHModel: the Mamba2 transforms above, q / k permuted):
  ffn_up_exps / _down_    the experts stacked [E, ...]           mixer.experts.up_proj / down_
                                                                  (transformers' stacks)
  ffn_gate_inp, exp_probs_b.bias: the router and its correction bias; ffn_up_shexp /
  ffn_down_shexp the shared expert; ffn_latent_down / _up the latent projections
Falcon-H1 (FalconH1Model: the Mamba2 transforms, no q / k permutation: NEOX rope): the muP
multipliers the converter folded into the weights stay folded (config/gguf_falcon_h1.py sets
them to 1); model.* names, the mixer under `mamba`, the MLP under `feed_forward`.
Names are Mamba2 / Nemotron-H's `backbone.*` (NVIDIA's and state-spaces' spelling;
nemotron_h.py reads transformers' model.* too), Granite's and Qwen3.5's `model.*`. A_log comes
back as log(-A): exp of it is A to within a float32 rounding, which the model applies as
-exp(A_log) like an HF checkpoint (an A with a value >= 0 is no -exp(A_log) and is refused).
Every tensor is dequantized to float32, or with --quantization gguf a matrix in a block type
the GGUF kernels take stays in its blocks (PackedRows: the transforms above that move rows --
q / k unpermuted, value heads untiled, halves joined, in_proj_qkvz regrouped, experts apart
-- move its block rows; Qwen3.5's ssm_out, whose columns move, and the token embedding are
dequantized); the hybrids' weight tables stage them (hybrid_base.WeightTable).
"""
from __future__ import annotations

import re
from typing import Any, Iterator

import numpy as np
import torch
from tqdm import tqdm

from kvstrata.runner.models.gguf_weights import dequantize, unpermute_qk

MODEL_TYPES = ("mamba2", "nemotron_h", "granitemoehybrid", "qwen3_5_text", "qwen3_5_moe_text",
               "qwen3_next", "falcon_h1")
_MAMBA = {"ssm_in": "in_proj", "ssm_conv1d": "conv1d", "ssm_norm": "norm", "ssm_out": "out_proj"}
# tensors the converter stores under other names or with no suffix -> the mixer's parameter
_MAMBA_BARE = {("ssm_a", None): "A_log", ("ssm_d", None): "D", ("ssm_dt", "bias"): "dt_bias"}


class _Names:
    """One family's names: its global tensors, the prefix of layer N, each llama.cpp block
    tensor's HF module, where its Mamba2 mixer lives, and the pairs the converter split off
    one fused HF tensor ((gate, up) -> the fused module, and the axis they are stacked on or a
    function (config, first, second) -> the fused tensor)."""

    def __init__(self, global_names: dict, layer: str, block: dict, mixer: str,
                 fused: dict | None = None, permuted_qk: bool = True,
                 per_expert: dict | None = None, bare: dict | None = None):
        self.global_names, self.layer, self.mixer = global_names, layer, mixer
        # expert stacks [E, ...] the converter merged from per-expert tensors -> their module
        # under experts.{e}
        self.per_expert = per_expert or {}
        self.permuted_qk = permuted_qk  # LlamaModel.permute ran on attn_q / attn_k
        self.block = {**{k: f"{mixer}.{v}" for k, v in _MAMBA.items()}, **block}
        # (kind, suffix) -> the full name under the layer, for tensors whose HF name has no
        # .weight / .bias suffix or another one
        self.bare = {**{k: f"{mixer}.{v}" for k, v in _MAMBA_BARE.items()}, **(bare or {})}
        self.fused = fused or {}


_BACKBONE = _Names(
    {"token_embd.weight": "backbone.embeddings.weight",
     "output_norm.weight": "backbone.norm_f.weight", "output.weight": "lm_head.weight"},
    "backbone.layers", {"attn_norm": "norm", "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj",
                        "attn_v": "mixer.v_proj", "attn_output": "mixer.o_proj",
                        "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
                        # Nemotron-H's MoE blocks (nemotron_h_moe)
                        "ffn_gate_inp": "mixer.gate",
                        "ffn_up_shexp": "mixer.shared_experts.up_proj",
                        "ffn_down_shexp": "mixer.shared_experts.down_proj",
                        "ffn_latent_down": "mixer.fc1_latent_proj",
                        "ffn_latent_up": "mixer.fc2_latent_proj"}, "mixer",
    bare={("exp_probs_b", "bias"): "mixer.gate.e_score_correction_bias",
          ("ffn_up_exps", "weight"): "mixer.experts.up_proj",
          ("ffn_down_exps", "weight"): "mixer.experts.down_proj"})
# transformers' model.* checkpoints' global tensors (Granite-4.0-H, Qwen3.5)
_MODEL_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# Granite-4.0-H (GraniteMoeModel.modify_tensors split input_linear into gate and up halves:
# the experts' [E, 2I, H] on axis 1, the shared MLP's [2S, H] on axis 0, named *_shexp beside
# experts and plain ffn_gate / ffn_up without)
_GRANITE = _Names(
    _MODEL_GLOBAL,
    "model.layers", {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                     "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                     "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                     "ffn_gate_inp": "block_sparse_moe.router.layer",
                     "ffn_down_exps": "block_sparse_moe.output_linear",
                     "ffn_down_shexp": "shared_mlp.output_linear",
                     "ffn_down": "shared_mlp.output_linear"}, "mamba",
    {("ffn_gate_exps", "ffn_up_exps"): ("block_sparse_moe.input_linear", 1),
     ("ffn_gate_shexp", "ffn_up_shexp"): ("shared_mlp.input_linear", 0),
     ("ffn_gate", "ffn_up"): ("shared_mlp.input_linear", 0)})
# Qwen3.5 (Qwen3_5TextModel: Gated DeltaNet's in_proj_qkv / _z / _b / _a as attn_qkv,
# attn_gate, ssm_beta, ssm_alpha; no rope permutation, rope is NEOX-style there)
_QWEN35 = _Names(
    _MODEL_GLOBAL,
    "model.layers", {"attn_norm": "input_layernorm",
                     "post_attention_norm": "post_attention_layernorm",
                     "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                     "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                     "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                     "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                     "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                     "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                     "ffn_down": "mlp.down_proj"}, "linear_attn", permuted_qk=False)


def _group_qkvz(config: Any, qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Qwen3NextModel split in_proj_qkvz, grouped per key head ([q_h, k_h, v_h, z_h] for each
    of the key heads h), into attn_qkv = [q, k, v] of all heads and attn_gate = z: regroup."""
    nk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    vz = config.linear_num_value_heads // nk * config.linear_value_head_dim
    q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
    parts = [x.reshape(nk, -1, x.shape[-1]) for x in (q, k, v, z)]
    assert parts[2].shape[1] == vz == parts[3].shape[1]
    return np.concatenate(parts, axis=1).reshape(-1, qkv.shape[-1])


# Qwen3-Next (Qwen3NextModel: in_proj_qkvz as attn_qkv + attn_gate; in_proj_ba as ssm_ba,
# grouped as HF; every layer a MoE with a gated shared expert, the experts merged into
# [E, ...] stacks by Qwen2MoeModel)
_QWEN3NEXT = _Names(
    _MODEL_GLOBAL, "model.layers",
    {**{k: v for k, v in _QWEN35.block.items() if not k.startswith(("attn_qkv", "attn_gate",
                                                                   "ssm_beta", "ssm_alpha",
                                                                   "ffn_"))},
     "ssm_ba": "linear_attn.in_proj_ba",
     "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
     "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
     "ffn_down_shexp": "mlp.shared_expert.down_proj"}, "linear_attn",
    {("attn_qkv", "attn_gate"): ("linear_attn.in_proj_qkvz", _group_qkvz)}, permuted_qk=False,
    per_expert={"ffn_gate_exps": "mlp.experts.{e}.gate_proj",
                "ffn_up_exps": "mlp.experts.{e}.up_proj",
                "ffn_down_exps": "mlp.experts.{e}.down_proj"})
# Qwen3.5-MoE (Qwen3_5MoeTextModel: Qwen3.5's layers and value-head order, Qwen3-Next's MoE
# names and expert stacks)
_QWEN35MOE = _Names(
    _MODEL_GLOBAL, "model.layers",
    {**{k: v for k, v in _QWEN35.block.items() if not k.startswith("ffn_")},
     **{k: v for k, v in _QWEN3NEXT.block.items() if k.startswith("ffn_")}}, "linear_attn",
    permuted_qk=False, per_expert=_QWEN3NEXT.per_expert)
# Falcon-H1 (FalconH1Model: attention and the Mamba2 mixer in every layer, rope NEOX-style)
_FALCON_H1 = _Names(
    {"token_embd.weight": "model.embed_tokens.weight",
     "output_norm.weight": "model.final_layernorm.weight", "output.weight": "lm_head.weight"},
    "model.layers", {"attn_norm": "input_layernorm", "ffn_norm": "pre_ff_layernorm",
                     "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                     "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                     "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
                     "ffn_down": "feed_forward.down_proj"}, "mamba", permuted_qk=False,
    # pre_ff_layernorm maps to FFN_PRE_NORM with its .weight in the key: written suffix-less
    bare={("ffn_norm", None): "pre_ff_layernorm.weight"})
_FAMILIES = {"mamba2": _BACKBONE, "nemotron_h": _BACKBONE, "granitemoehybrid": _GRANITE,
             "qwen3_5_text": _QWEN35, "qwen3_5_moe_text": _QWEN35MOE, "qwen3_next": _QWEN3NEXT,
             "falcon_h1": _FALCON_H1}
# Qwen3.5's zero-centred RMSNorms, stored as 1 + w (Qwen3NextModel.modify_tensors; not the
# gated norm of the linear layers)
_ONE_PLUS_W = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")
_NAME_RE = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def hf_name(gguf_name: str, model_type: str) -> tuple[str, str]:
    """(HF name, llama.cpp's short tensor kind: token_embd, output_norm, output for the global
    ones); for one half of a split tensor, the fused tensor's name. ValueError for a tensor
    nothing maps."""
    names = _FAMILIES[model_type]
    if gguf_name in names.global_names:
        return names.global_names[gguf_name], gguf_name.split(".")[0]
    m = _NAME_RE.match(gguf_name)
    if m:
        layer, kind, suffix = m.groups()
        prefix = f"{names.layer}.{layer}"
        if (kind, suffix) in names.bare:
            return f"{prefix}.{names.bare[kind, suffix]}", kind
        if kind in names.block and suffix is not None:
            return f"{prefix}.{names.block[kind]}.{suffix}", kind
        for pair, (module, _) in names.fused.items():
            if kind in pair and suffix == "weight":
                return f"{prefix}.{module}.weight", kind
        if kind in names.per_expert and suffix == "weight":
            return f"{prefix}.{names.per_expert[kind]}.weight", kind  # {e}: each expert
    raise ValueError(f"GGUF tensor {gguf_name!r} has no mapping for a {model_type} model")


def undo_converter(kind: str, w: np.ndarray, config: Any, gguf_name: str) -> np.ndarray:
    """The HF tensor from the converter's stored values (the table above)."""
    names = _FAMILIES[config.model_type]
    if names in (_QWEN35, _QWEN35MOE, _QWEN3NEXT):
        w = _undo_qwen(kind, w, config, gguf_name, tiled_v=names is not _QWEN3NEXT)
    if kind == "ssm_a":
        if not (w < 0).all():
            raise ValueError(f"GGUF tensor {gguf_name!r} holds values >= 0: not the converter's "
                             f"-exp(A_log)")
        return np.log(-w).reshape(-1)
    if kind in ("ssm_d", "ssm_norm"):
        return w.reshape(-1)
    if kind == "ssm_conv1d" and gguf_name.endswith(".weight"):
        return w[:, None, :]
    if names.permuted_qk and kind == "attn_q" and gguf_name.endswith(".weight"):
        return unpermute_qk(w, config.num_attention_heads)
    if names.permuted_qk and kind == "attn_k" and gguf_name.endswith(".weight"):
        return unpermute_qk(w, config.num_key_value_heads)
    return w


def _untile_v(w: np.ndarray, axis: int, config: Any, head_dim: int) -> np.ndarray:
    """_LinearAttentionVReorderBase stored V heads tiled ([K0, K1, .., K0, K1, ..]) where HF
    groups them by key head ([G0 v0..v(r-1), G1 ..]): back to grouped, along `axis`."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(nv // nk, nk, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(w, 0, axis)


def _undo_qwen(kind: str, w: np.ndarray, config: Any, gguf_name: str, tiled_v: bool
               ) -> np.ndarray:
    """Qwen3-Next's and Qwen3.5's own transforms: the norms' 1 + w back to w (the model adds
    the 1 at load, as for an HF checkpoint); Qwen3.5's V heads (tiled_v) back in grouped order
    when there are more value heads than key heads."""
    if kind in _ONE_PLUS_W:
        return w - 1.0
    if not tiled_v or config.linear_num_key_heads == config.linear_num_value_heads:
        return w
    dv = config.linear_value_head_dim
    if kind in ("attn_qkv", "ssm_conv1d") and gguf_name.endswith(".weight"):
        qk = (2 * config.linear_num_key_heads * config.linear_key_head_dim)
        return np.concatenate([w[:qk], _untile_v(w[qk:], 0, config, dv)])
    if kind == "attn_gate":
        return _untile_v(w, 0, config, dv)
    if kind in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
        return _untile_v(w, 0, config, 1)
    if kind == "ssm_out":
        return _untile_v(w, 1, config, dv)
    return w


def iter_hybrid_gguf(gguf_path: str, config: Any, keep_quantized: bool = False
                     ) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 tensor) of every tensor of the file, in file order; a split tensor
    once both halves are read (gate first, as the converter split it). keep_quantized
    (--quantization gguf): a matrix whose transforms only move rows comes as PackedRows (a
    whole expert stack the model reads as one tensor: a list of them, one per expert;
    `_packable`)."""
    from kvstrata.runner.models.gguf_index import read_gguf_tensors

    names = _FAMILIES[config.model_type]
    halves = {kind: (pair, join) for pair, (_, join) in names.fused.items() for kind in pair}
    pending: dict[str, dict[str, Any]] = {}
    for t in tqdm(read_gguf_tensors(gguf_path), desc="Loading GGUF", unit="tensor",
                  leave=False):
        block = _BLOCK_RE.match(t.name)
        if block and int(block.group(1)) >= config.num_hidden_layers:
            continue  # an MTP block after the model's layers (Qwen3.5's nextn): not read
        name, kind = hf_name(t.name, config.model_type)
        if keep_quantized and _packable(t, kind, config):
            # the converter's row transforms on the blocks' rows: (raw rows, qtype)
            w = (undo_converter(kind, np.array(t.data), config, t.name), int(t.tensor_type))
        else:
            w = undo_converter(kind, np.asarray(dequantize(t.data, t.tensor_type), np.float32),
                               config, t.name)
        if kind in halves:
            (first, second), join = halves[kind]
            pending.setdefault(name, {})[kind] = w
            if len(pending[name]) < 2:
                continue
            parts = pending.pop(name)
            w = _join(config, parts[first], parts[second], join)
        if kind in names.per_expert:
            for e in range(_rows(w).shape[0]):
                yield name.format(e=e), _as_weight(w, e, t)
            continue
        yield name, _as_weight(w, None, t)
    if pending:
        raise ValueError(f"{gguf_path}: {sorted(pending)} have only one of the two tensors "
                         f"the converter split them into")


def _packable(t: Any, kind: str, config: Any) -> bool:
    """A block matrix (or expert stack) the GGUF kernels take, whose converter transforms
    only move rows: not the token embedding (looked up as a float table), not Qwen3.5's
    ssm_out when its value heads were tiled (a column reorder: dequantized)."""
    import gguf

    from kvstrata.runner.cpu import gguf_matmul

    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    tiled_out = (kind == "ssm_out" and _FAMILIES[config.model_type] in (_QWEN35, _QWEN35MOE)
                 and config.linear_num_key_heads != config.linear_num_value_heads)
    return (t.data.ndim in (2, 3) and gguf.GGML_QUANT_SIZES[qtype][0] > 1
            and gguf_matmul.supported(t.tensor_type) and kind != "token_embd"
            and not tiled_out)


def _rows(w: Any) -> np.ndarray:
    return w[0] if isinstance(w, tuple) else w


def _join(config: Any, first: Any, second: Any, join: Any) -> Any:
    """Two halves as the fused tensor: raw rows joined where both kept one block type, else
    both dequantized (a half the file stored in another type)."""
    same = (isinstance(first, tuple) and isinstance(second, tuple) and first[1] == second[1])
    a, b = (_rows(first), _rows(second)) if same else (_float(first), _float(second))
    fused = join(config, a, b) if callable(join) else np.concatenate([a, b], axis=join)
    return (fused, first[1]) if same else fused


def _float(w: Any) -> np.ndarray:
    if not isinstance(w, tuple):
        return w
    raw, qtype = w
    flat = dequantize(raw.reshape(-1, raw.shape[-1]), qtype)
    return np.asarray(flat, np.float32).reshape(*raw.shape[:-1], -1)


def _as_weight(w: Any, expert: int | None, t: Any) -> Any:
    """What the model's load_weight takes: a float tensor (np.array copies: dequantize may
    return a read-only view of the memory-mapped file), PackedRows, or for a whole expert
    stack one PackedRows per expert."""
    from kvstrata.runner.quant.packed_rows import PackedRows

    if not isinstance(w, tuple):
        w = w if expert is None else w[expert]
        return torch.from_numpy(np.array(w, copy=True))
    raw, qtype = w
    cols = int(t.shape[0])  # gguf's innermost dimension: the input width
    rows = torch.from_numpy(np.array(raw if expert is None else raw[expert]))
    if rows.dim() == 3:  # a stack the model reads whole (Granite's, Nemotron-H MoE's)
        return [PackedRows(qtype, rows[e], cols) for e in range(rows.shape[0])]
    return PackedRows(qtype, rows, cols)


__all__ = ["MODEL_TYPES", "hf_name", "iter_hybrid_gguf", "undo_converter"]
