"""Our decoder-only transformer for the llama family (llama, mistral, qwen2, qwen3).

One module with per-architecture flags instead of one file per model: the families differ
only in biases and per-head q/k norms. Projections are fused at load time (q|k|v into one
weight, gate|up into one) so each layer runs 4 matmuls over the whole flattened batch;
on CPU per-op overhead, not FLOPs, dominates small-batch decode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.config.hf_config import ModelDims, layer_windows
from kvstrata.runner.cpu import fused_ops as cpu_ops
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models import decode_plan
from kvstrata.runner.models.rope import (RotaryEmbedding, apply_rope, rope_parameters,
                                         rotary_dim)
from kvstrata.runner.quant import gguf_linear
from kvstrata.runner.quant.packed_rows import PackedRows


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool = False   # qwen2: bias on q/k/v only
    qk_norm: bool = False    # qwen3: RMSNorm over each head of q and k, before RoPE
    gguf_permute_qk: bool = False  # llama.cpp permutes q/k rows for these (llama, mistral)
    # Which model class builds it: "decoder" (this module), "gemma" (gemma.py), "gpt_oss"
    # (gpt_oss.py: sliding windows, attention sinks, MoE), "moe" (moe_decoder.py: this
    # decoder with expert MLPs: Qwen3-MoE, Qwen2-MoE, Mixtral, Glm4Moe), "deepseek" (deepseek.py:
    # MLA, and DSA on V3.2) or a hybrid with recurrent state: "qwen3_next" / "nemotron_h" /
    # "granite_hybrid" / "falcon_h1" (hybrids.py).
    family: str = "decoder"
    # gemma2: attention logits soft-capped by config.attn_logit_softcapping (transformers'
    # Gemma 3 carries the field but never applies it)
    attn_logit_softcapping: bool = False


def is_llama_family(model: Any) -> bool:
    """The plain decoder of this module (llama, mistral, qwen2, qwen3; a tensor-parallel
    rank's share too): what --quantization, speculative drafts and EAGLE heads are built
    for. Not a subclass of another family (gemma.py) nor DeepSeek."""
    spec = getattr(model, "spec", None)
    return spec is not None and spec.family == "decoder"


def nope_layers(config: Any, num_layers: int) -> frozenset[int]:
    """Layers that attend without rotary: SmolLM3's no_rope_layers (1 = rope, 0 = NoPE)."""
    flags = getattr(config, "no_rope_layers", None)
    if flags is None:
        return frozenset()
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return frozenset(i for i, use_rope in enumerate(flags) if not use_rope)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by the loader (checked there).
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as HF (normalise in float32, cast back, then scale by the weight).
    fused = cpu_ops.rms_norm(x, weight, eps)  # bf16 / fp32 on CPU: one pass, same roundings
    if fused is not None:
        return fused
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_heads(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
               ) -> torch.Tensor:
    """x [T, H, D] (its own buffer, contiguous) rotated in place where it can be: all of each
    head, or its first cos.shape[-1] dims (partial rotary); cos None: a NoPE layer."""
    if cos is None:
        return x
    t, heads, d = x.shape
    if cos.shape[-1] != d:
        part = x[..., :cos.shape[-1]]
        part.copy_(apply_rope(part, cos, sin))
        return x
    if cpu_ops.rope_(x.view(t, -1), heads, cos, sin):
        return x
    return apply_rope(x, cos, sin)


def rope_qk(qkv: torch.Tensor, nq: int, nkv: int, hd: int, cos: torch.Tensor | None,
            sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, nq, hd] and k [T, nkv, hd] of a fused q|k|v projection's output, rotated (all
    of each head, or its first cos.shape[-1] dims; not at all where cos is None)."""
    t, q_end, k_end = qkv.shape[0], nq * hd, (nq + nkv) * hd
    if cos is None or cos.shape[-1] != hd:
        qk = rope_heads(qkv[:, :k_end].view(t, nq + nkv, hd), cos, sin)
        return qk[:, :nq], qk[:, nq:]
    if cpu_ops.rope_(qkv, nq + nkv, cos, sin):
        # Rotated in place (qkv is this layer's own buffer): q and k stay views of it.
        return qkv[:, :q_end].view(t, nq, hd), qkv[:, q_end:k_end].view(t, nkv, hd)
    # q and k heads sit side by side in qkv: rotate them with one set of ops.
    qk = apply_rope(qkv[:, :k_end].view(t, nq + nkv, hd), cos, sin)
    return qk[:, :nq], qk[:, nq:]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: "ModelDims", spec: ArchSpec, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
        kw = dict(dtype=dtype, device=device)
        self.input_norm = _param(h, **kw)
        self.qkv_weight = _param(qkv_out, h, **kw)
        self.qkv_bias = _param(qkv_out, **kw) if (spec.qkv_bias or cfg.attention_bias) else None
        self.o_weight = _param(h, cfg.num_heads * d, **kw)
        # qwen2's fixed q/k/v bias never extends to o_proj; llama/qwen3's attention_bias does.
        self.o_bias = _param(h, **kw) if cfg.attention_bias and not spec.qkv_bias else None
        self.q_norm = _param(d, **kw) if spec.qk_norm else None
        self.k_norm = _param(d, **kw) if spec.qk_norm else None
        self.post_norm = _param(h, **kw)
        self.gate_up_weight = _param(2 * cfg.intermediate_size, h, **kw)
        self.down_weight = _param(h, cfg.intermediate_size, **kw)
        self.gate_up_bias = _param(2 * cfg.intermediate_size, **kw) if cfg.mlp_bias else None
        self.down_bias = _param(h, **kw) if cfg.mlp_bias else None


def copy_weight(param: torch.Tensor | None, tensor: "torch.Tensor | PackedRows", key: str,
                name: str = "", lo: int | None = None, hi: int | None = None) -> list[str]:
    """tensor into param's rows lo..hi (all of it: None); a weight kept quantized
    (PackedRows) is staged there instead, to become a packed layer after loading
    (runner/quant/gguf_linear.py). Every model's weight loader copies through it (the
    decoder classes as `self._copy`). Returns [key], the loaded key."""
    if param is None:
        raise KeyError(f"{name or key}: this architecture has no such parameter")
    if isinstance(tensor, PackedRows):
        lo, hi = (0, param.shape[0]) if lo is None else (lo, hi)
        if param.dim() != 2 or tuple(tensor.shape) != (hi - lo, param.shape[1]):
            raise ValueError(f"{name or key}: checkpoint shape {tuple(tensor.shape)} != "
                             f"expected {tuple(param.data[lo:hi].shape)}")
        gguf_linear.stage(param, tensor, lo, hi)
        return [key]
    dst = param.data if lo is None else param.data[lo:hi]
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"{name or key}: checkpoint shape {tuple(tensor.shape)} != "
                         f"expected {tuple(dst.shape)}")
    dst.copy_(tensor)
    return [key]


class DecoderForCausalLM(nn.Module):
    pool_kind = "mha"
    layer_class = DecoderLayer  # a subclass with more per-layer parameters sets its own
    # attention sinks or logit soft-capping (gpt-oss, Gemma 2): under deterministic inference
    # those layers keep the paged decode kernel's order (torch_native.py `fixed_order`)
    softmax_extras = False

    def __init__(self, config: Any, spec: ArchSpec, dtype: torch.dtype, device: torch.device,
                 dims: ModelDims | None = None):
        """`dims`: this replica's shapes when they are not the config's (a tensor-parallel
        rank's share of heads, MLP width and vocabulary: runner/parallel/)."""
        super().__init__()
        self.config = config
        self.spec = spec
        self.dims = dims = dims or ModelDims.from_config(config)
        self.dtype = dtype
        self.device = device
        kw = dict(dtype=dtype, device=device)
        self.embed = _param(dims.vocab_size, dims.hidden_size, **kw)
        self.layers = nn.ModuleList(self.make_layer(i, dims, spec, dtype, device)
                                    for i in range(dims.num_layers))
        self.final_norm = _param(dims.hidden_size, **kw)
        # Tied (SmolLM2): the output projection IS the embedding matrix, no second copy.
        self.lm_head = self.embed if dims.tie_word_embeddings else _param(
            dims.vocab_size, dims.hidden_size, **kw)
        rope = rope_parameters(config)
        self.rotary = RotaryEmbedding(rotary_dim(dims.head_dim, rope), rope, device,
                                      getattr(config, "max_position_embeddings", None))
        # SmolLM3: `no_rope_layers[i]` 0 = layer i attends without rotary (NoPE)
        self.nope_layers = nope_layers(config, dims.num_layers)
        self.attn_backend = None  # set by the runner (needs the KV pool)
        # Per layer its sliding window (Mistral: every layer; Qwen2/3 with
        # use_sliding_window: the "sliding_attention" layer_types), None = full; the runner
        # hands it to the attention backend, which applies it (the pool keeps all KV).
        self.layer_windows = layer_windows(config)
        # How a (weight, bias) pair is applied: F.linear, or after --quantization the int8
        # layer that replaced the weight (runner/quant/w8a8.py), or the packed GGUF layer
        # (runner/quant/gguf_linear.py).
        self.linear = F.linear
        self.capture_hidden = False  # keep last_hidden (an EAGLE draft's features)
        self.capture_layers: tuple[int, ...] = ()  # EAGLE3: the streams entering these
        self.last_hidden: torch.Tensor | None = None

    @torch.inference_mode()
    @cpu_ops.fixed_settings
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Run all tokens of `fb`; return logits [len(fb.logits_idx), V] in float32
        (every token when logits_idx is None). With `capture_hidden` set (an EAGLE draft
        reads them), `last_hidden` keeps every token's final-normed hidden state."""
        self.attn_backend.init_forward_metadata(fb)
        cos, sin = self.rotary.cos_sin(fb.positions, self.dtype)
        x = self.embed_tokens(fb.input_ids)
        aux = []
        # A CPU decode step: every layer as C calls bound once (decode_plan.py); else the loop.
        plan = decode_plan.build(self, fb, x, cos, sin) if self._plain_layers() else None
        if plan is not None:
            x = plan.run()
        for i, layer in enumerate(self.layers if plan is None else ()):
            if i in self.capture_layers:  # an EAGLE3 head's features: the stream entering i
                aux.append(x.clone())
            if i in self.nope_layers:
                x = self.layer_forward(i, layer, x, None, None, fb)
            else:
                x = self.layer_forward(i, layer, x, cos, sin, fb)
        if aux:
            self.last_hidden = torch.cat(aux, dim=-1)
        elif self.capture_hidden:
            x = self.final_rms_norm(x)
            self.last_hidden = x
            if fb.logits_idx is not None:
                x = x.index_select(0, fb.logits_idx)
            return self.output_logits(x)
        if fb.logits_idx is not None:
            # Norm + lm_head only where logits are wanted: the vocab matmul is the largest.
            x = x.index_select(0, fb.logits_idx)
        return self.output_logits(self.final_rms_norm(x))

    def final_rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's last norm (gpt-oss overrides it: float32 weight, scaled unrounded)."""
        return rms_norm(x, self.final_norm, self.dims.rms_norm_eps)

    def make_layer(self, i: int, dims: ModelDims, spec: ArchSpec, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
        """Layer i's parameters: `layer_class`'s (gemma.py sets its own), or what a subclass
        whose layers need more than the dims builds (gpt_oss.py: the expert count)."""
        return self.layer_class(dims, spec, dtype, device)

    def _plain_layers(self) -> bool:
        """This model's layers are layer_forward's with an identity reduce and the dense MLP
        (decode_plan.py replays exactly those): not a tensor-parallel rank's nor an MoE's."""
        cls = type(self)
        return (cls.layer_forward is DecoderForCausalLM.layer_forward
                and cls.reduce is DecoderForCausalLM.reduce
                and cls.mlp is DecoderForCausalLM.mlp)

    # A tensor-parallel rank (runner/parallel/) overrides these three: its embedding and
    # head hold a slice of the vocabulary, its o/down projections a slice of their inputs.
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if type(self.embed) is gguf_linear.GgufLinear:  # kept packed: only these rows
            return self.embed.lookup(ids).to(self.dtype)
        return F.embedding(ids, self.embed)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        # kvstrata's bf16 GEMM writes the fp32 logits itself (runner/cpu/packed_linear.py).
        as_float = getattr(self.lm_head, "linear_float", None)
        logits = as_float(x) if as_float is not None else None
        return logits if logits is not None else self.linear(x, self.lm_head).float()

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output summed over ranks (identity on one rank)."""
        return partial

    def layer_forward(self, i: int, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, fb: ForwardBatch, input_norm: bool = True
                      ) -> torch.Tensor:
        """One decoder layer over the residual stream `x` (updated in place and returned).
        `input_norm=False`: the layer reads x unnormalised (an EAGLE head's first layer)."""
        d = self.dims
        nq, nkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
        q_end, k_end = nq * hd, (nq + nkv) * hd
        t = x.shape[0]
        linear = self.linear
        h = rms_norm(x, layer.input_norm, d.rms_norm_eps) if input_norm else x
        qkv = linear(h, layer.qkv_weight, layer.qkv_bias)
        v = qkv[:, k_end:].view(t, nkv, hd)
        if layer.q_norm is not None:
            q = rms_norm(qkv[:, :q_end].view(t, nq, hd), layer.q_norm, d.rms_norm_eps)
            k = rms_norm(qkv[:, q_end:k_end].view(t, nkv, hd), layer.k_norm, d.rms_norm_eps)
            # in place: q and k are the norms' own outputs
            q, k = rope_heads(q, cos, sin), rope_heads(k, cos, sin)
        else:
            q, k = rope_qk(qkv, nq, nkv, hd, cos, sin)
        attn = self.attn_backend.forward(i, q, k, v, fb)
        # In place: x is this forward's own buffer (from F.embedding or a linear), never a
        # view of a parameter, and inference mode keeps no autograd history.
        o = self.reduce(linear(attn, layer.o_weight, layer.o_bias))
        h = cpu_ops.add_rms_norm(x, o, layer.post_norm, d.rms_norm_eps)  # CPU: one pass
        if h is None:
            x.add_(o)
            h = rms_norm(x, layer.post_norm, d.rms_norm_eps)
        x.add_(self.reduce(self.mlp(layer, h)))
        return x

    def mlp(self, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        """The feed-forward block over the post-attention-normed `h` (before reduce): the
        dense SwiGLU here; moe_decoder.py's models send their MoE layers to experts."""
        linear = self.linear
        # An int8 layer dequantises inside the activation's pass (runner/cpu/int8_linear.py).
        fused = getattr(layer.gate_up_weight, "linear_silu_mul", None)
        act = fused(h) if fused is not None else None
        if act is None:
            gate_up = linear(h, layer.gate_up_weight, layer.gate_up_bias)
            act = cpu_ops.silu_mul(gate_up)  # one pass on CPU; None elsewhere
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return linear(act, layer.down_weight, layer.down_bias)

    # ------------------------------------------------------------------ weight loading
    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Copy one HF-named tensor into our (possibly fused) parameter. Returns the keys of
        what it filled, so the loader can check that everything was loaded exactly once."""
        d = self.dims
        if name in ("model.embed_tokens.weight",):
            return self._copy(self.embed, tensor, "embed")
        if name == "model.norm.weight":
            return self._copy(self.final_norm, tensor, "final_norm")
        if name == "lm_head.weight":
            if d.tie_word_embeddings:
                return []  # some checkpoints store the tied copy too; the embedding wins
            return self._copy(self.lm_head, tensor, "lm_head")
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            raise KeyError(name)
        idx = int(parts[2])
        layer = self.layers[idx]
        sub = ".".join(parts[3:])
        pre = f"layers.{idx}."
        hd = d.head_dim
        q_rows, kv_rows = d.num_heads * hd, d.num_kv_heads * hd
        qkv_slices = {"q_proj": (0, q_rows), "k_proj": (q_rows, q_rows + kv_rows),
                      "v_proj": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
        mlp_slices = {"gate_proj": (0, d.intermediate_size),
                      "up_proj": (d.intermediate_size, 2 * d.intermediate_size)}
        simple = {"input_layernorm.weight": "input_norm",
                  "post_attention_layernorm.weight": "post_norm",
                  "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
                  "self_attn.o_proj.weight": "o_weight", "self_attn.o_proj.bias": "o_bias",
                  "mlp.down_proj.weight": "down_weight", "mlp.down_proj.bias": "down_bias"}
        if sub in simple:
            return self._copy(getattr(layer, simple[sub]), tensor, pre + simple[sub], name)
        group, proj, kind = parts[3], parts[4], parts[-1]
        # Phi-3 stores the fusions we make: q|k|v as qkv_proj, gate|up as gate_up_proj.
        if group == "self_attn" and proj == "qkv_proj":
            target = layer.qkv_weight if kind == "weight" else layer.qkv_bias
            self._copy(target, tensor, f"{pre}{proj}.{kind}", name)
            return [f"{pre}{p}.{kind}" for p in qkv_slices]
        if group == "mlp" and proj == "gate_up_proj":
            target = layer.gate_up_weight if kind == "weight" else layer.gate_up_bias
            self._copy(target, tensor, f"{pre}{proj}.{kind}", name)
            return [f"{pre}{p}.{kind}" for p in mlp_slices]
        if group == "self_attn" and proj in qkv_slices:
            lo, hi = qkv_slices[proj]
            target = layer.qkv_weight if kind == "weight" else layer.qkv_bias
            return self._copy(target, tensor, f"{pre}{proj}.{kind}", name, lo, hi)
        if group == "mlp" and proj in mlp_slices:
            lo, hi = mlp_slices[proj]
            target = layer.gate_up_weight if kind == "weight" else layer.gate_up_bias
            return self._copy(target, tensor, f"{pre}{proj}.{kind}", name, lo, hi)
        raise KeyError(name)

    _copy = staticmethod(copy_weight)

    def expected_keys(self) -> set[str]:
        keys = {"embed", "final_norm"}
        if not self.dims.tie_word_embeddings:
            keys.add("lm_head")
        for i, layer in enumerate(self.layers):
            pre = f"layers.{i}."
            keys |= {pre + k for k in ("input_norm", "post_norm", "o_weight", "down_weight")}
            keys |= {f"{pre}{p}.weight" for p in ("q_proj", "k_proj", "v_proj",
                                                   "gate_proj", "up_proj")}
            if layer.qkv_bias is not None:
                keys |= {f"{pre}{p}.bias" for p in ("q_proj", "k_proj", "v_proj")}
            for attr in ("o_bias", "down_bias", "q_norm", "k_norm"):
                if getattr(layer, attr) is not None:
                    keys.add(pre + attr)
            if layer.gate_up_bias is not None:
                keys |= {f"{pre}{p}.bias" for p in ("gate_proj", "up_proj")}
        return keys
