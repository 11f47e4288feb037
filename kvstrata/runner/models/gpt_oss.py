"""gpt-oss (GptOssForCausalLM): the llama-family decoder with four differences.

- Attention: q/k/v/o with biases; alternating sliding-window / full layers
  (`config.layer_types`, window `sliding_window`); a learned logit per query head ("sink")
  that joins each softmax denominator without a value. The attention backend applies both
  (`layer_windows`, `sinks=`).
- RoPE: YaRN with its attention factor (rope.py), in HF's rotate-half layout.
- RMSNorm: transformers keeps the norm weights in float32 and scales before rounding
  (llama rounds first); identical in float32, kept so in half precision.
- FFN: a mixture of experts. The router (linear with bias) picks the top k logits, their
  softmax weighs the chosen experts. An expert is a clamped SwiGLU with biases:
  gate <= limit, -limit <= up <= limit, out = (up + 1) * gate * sigmoid(alpha * gate).
  Checkpoints interleave gate and up columns (gate even, up odd); we store them split
  (rows 0..I-1 gate, I..2I-1 up) and transposed to [out, in], so each expert is two linear
  calls over the tokens routed to it (moe.routed_sum: one call per chosen expert per step),
  on the CPU each a PackedLinear with its bias inside (fixed_experts.pack_moe_layers).

Released checkpoints hold the experts as MXFP4 (`*_blocks`, `*_scales`), dequantized here at
load to the model dtype (quant/mxfp4.py). GGUF files (llama.cpp arch gpt-oss) hold them as
[E, out, in] stacks, gate and up apart, MXFP4 blocks dequantized by gguf_weights.py: loaded
into the same parameters (`_GGUF_EXPERTS`). The fused CPU decode plan (decode_plan.py) replays
the plain decoder only, so this model runs the per-layer loop.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.config.hf_config import ModelDims
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.decoder import (ArchSpec, DecoderForCausalLM, _param, rms_norm,
                                            rope_qk)
from kvstrata.runner.models.moe import routed_sum, row_sigmoid
from kvstrata.runner.quant.mxfp4 import dequantize_mxfp4

SWIGLU_ALPHA = 1.702  # transformers' default when a config does not name it
SWIGLU_LIMIT = 7.0
# What this model does not run yet, by flag: model_setup.refuse_unsupported_features names
# them before anything loads (load_serving_model refuses them again). NGRAM, STANDALONE and
# EAGLE / EAGLE3 speculation run (their verify and draft trees go through the same windowed,
# sink-aware attention; an EAGLE head reads the hidden states this model's forward keeps,
# the llama decoder's: tested beside the SWA pool, test_gpt_oss.py).
# --load-format gguf: a GGUF file's weights kept in their blocks (--quantization gguf): no
# packed kernel runs the 3-D MXFP4 experts; its GGUF files load dequantized.
# (--enable-deterministic-inference runs: the router and experts pinned on the fixed GEMM,
# GptOssLayer's pinned_*; the attention sinks inside the batch-invariant paged decode kernel,
# tests/correctness/test_paged_decode_softmax_extras.py.)
UNSUPPORTED = ("--quantization", "--load-format gguf")


class GptOssLayer(nn.Module):
    # Deterministic inference (runner/cpu/fixed_experts.py): the router and every expert on
    # the fixed GEMM, biases inside; batch_invariant: the GLU's sigmoid per row and the
    # combine in each token's top-k order.
    linear = staticmethod(F.linear)
    pinned_weights = (("router_weight", "router_bias"),)
    pinned_expert_stacks = (("gate_up", "gate_up_bias"), ("down", "down_bias"))
    batch_invariant = False

    def __init__(self, d: ModelDims, num_experts: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        h, hd, inter = d.hidden_size, d.head_dim, d.intermediate_size
        qkv_out = (d.num_heads + 2 * d.num_kv_heads) * hd
        kw = dict(dtype=dtype, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        self.input_norm = _param(h, **f32)
        self.qkv_weight = _param(qkv_out, h, **kw)
        self.qkv_bias = _param(qkv_out, **kw)
        self.o_weight = _param(h, d.num_heads * hd, **kw)
        self.o_bias = _param(h, **kw)
        # float32 whatever the model dtype: the attention backend's softmax is float32.
        self.sinks = _param(d.num_heads, **f32)
        self.post_norm = _param(h, **f32)
        self.router_weight = _param(num_experts, h, **kw)
        self.router_bias = _param(num_experts, **kw)
        self.gate_up = _param(num_experts, 2 * inter, h, **kw)
        self.gate_up_bias = _param(num_experts, 2 * inter, **kw)
        self.down = _param(num_experts, h, inter, **kw)
        self.down_bias = _param(num_experts, h, **kw)


# HF name under model.layers.N. -> (our attribute, fused-qkv part or None)
_LAYER_NAMES = {
    "input_layernorm.weight": ("input_norm", None),
    "post_attention_layernorm.weight": ("post_norm", None),
    "self_attn.q_proj.weight": ("qkv_weight", "q"), "self_attn.q_proj.bias": ("qkv_bias", "q"),
    "self_attn.k_proj.weight": ("qkv_weight", "k"), "self_attn.k_proj.bias": ("qkv_bias", "k"),
    "self_attn.v_proj.weight": ("qkv_weight", "v"), "self_attn.v_proj.bias": ("qkv_bias", "v"),
    "self_attn.o_proj.weight": ("o_weight", None), "self_attn.o_proj.bias": ("o_bias", None),
    "self_attn.sinks": ("sinks", None),
    "mlp.router.weight": ("router_weight", None), "mlp.router.bias": ("router_bias", None),
    "mlp.experts.gate_up_proj": ("gate_up", None),
    "mlp.experts.gate_up_proj_bias": ("gate_up_bias", None),
    "mlp.experts.down_proj": ("down", None), "mlp.experts.down_proj_bias": ("down_bias", None),
}
_MXFP4 = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# llama.cpp's expert tensors (GGUF: gguf_weights.py names them so), [E, out, in] and biases
# [E, out] -- our layout already: name under model.layers.N. -> (our attribute, the half of
# gate | up it fills or None for all of it)
_GGUF_EXPERTS = {
    "mlp.experts.gate_proj.weight": ("gate_up", 0), "mlp.experts.up_proj.weight": ("gate_up", 1),
    "mlp.experts.gate_up_proj.weight": ("gate_up", None),
    "mlp.experts.down_proj.weight": ("down", None),
    "mlp.experts.gate_proj.bias": ("gate_up_bias", 0),
    "mlp.experts.up_proj.bias": ("gate_up_bias", 1),
    "mlp.experts.gate_up_proj.bias": ("gate_up_bias", None),
    "mlp.experts.down_proj.bias": ("down_bias", None)}
# our attribute -> the HF name under model.layers.N. whose key it fills
_EXPERT_KEYS = {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj",
                "gate_up_bias": "mlp.experts.gate_up_proj_bias",
                "down_bias": "mlp.experts.down_proj_bias"}


class GptOssForCausalLM(DecoderForCausalLM):
    softmax_extras = True  # every layer's sinks (deterministic: the decode kernel's order)
    # KV per token like any MHA decoder; the sliding layers' extra pages are kept (the
    # window is applied by the attention, not by freeing pages yet).
    pool_kind = "mha"
    # The linear layers packed for the CPU GEMMs (runner/cpu/packed_linear.py): the 2-D
    # projections. Router and experts (GptOssLayer.pinned_*): fixed_experts.pack_moe_layers
    # (one PackedLinear per expert, biases inside), or pin_moe_layers under deterministic
    # inference.
    packed_linears = (("qkv_weight", "qkv_bias"), ("o_weight", "o_bias"))
    unsupported = UNSUPPORTED

    def __init__(self, config: Any, spec: ArchSpec, dtype: torch.dtype, device: torch.device,
                 dims: ModelDims | None = None):
        self.num_experts = int(config.num_local_experts)
        self.top_k = int(config.num_experts_per_tok)
        self.swiglu_alpha = float(getattr(config, "swiglu_alpha", None) or SWIGLU_ALPHA)
        self.swiglu_limit = float(getattr(config, "swiglu_limit", None) or SWIGLU_LIMIT)
        super().__init__(config, spec, dtype, device, dims)
        n = self.dims.num_layers
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"gpt_oss: layer_types must name sliding_attention or "
                             f"full_attention for each of the {n} layers, got {types!r}")
        window = getattr(config, "sliding_window", None)
        if "sliding_attention" in types and not window:
            raise ValueError("gpt_oss: sliding_attention layers need a sliding_window")
        # Per layer: the query at position p sees keys p-W+1 .. p (transformers' semantics);
        # None = full causal. The runner hands this to the attention backend.
        self.layer_windows: list[int | None] = [
            int(window) if t == "sliding_attention" else None for t in types]
        quant = getattr(config, "quantization_config", None) or {}
        method = quant.get("quant_method") if isinstance(quant, dict) else \
            getattr(quant, "quant_method", None)
        if method not in (None, "mxfp4"):
            raise ValueError(f"gpt_oss: quantization_config.quant_method {method!r} is not "
                             f"supported (unquantized or mxfp4 experts)")
        self._mxfp4_pending: dict[str, torch.Tensor] = {}
        self._gguf_halves: dict[str, set[int]] = {}  # key -> halves of gate | up loaded
        # float32 like the layers' norms (transformers keeps every norm so)
        self.final_norm = _param(self.dims.hidden_size, dtype=torch.float32, device=device)

    def make_layer(self, i: int, dims: ModelDims, spec: ArchSpec, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
        return GptOssLayer(dims, self.num_experts, dtype, device)

    # ------------------------------------------------------------------ forward
    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' GptOssRMSNorm: normalise in float32, scale by the float32 weight,
        then round (one rounding; llama rounds before scaling)."""
        if x.dtype == torch.float32:
            return rms_norm(x, weight, self.dims.rms_norm_eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.dims.rms_norm_eps)
        return (weight * xf).to(x.dtype)

    def final_rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.final_norm)

    def layer_forward(self, i: int, layer: GptOssLayer, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, fb: ForwardBatch, input_norm: bool = True
                      ) -> torch.Tensor:
        d = self.dims
        nq, nkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
        t = x.shape[0]
        qkv = self.linear(self.norm(x, layer.input_norm), layer.qkv_weight, layer.qkv_bias)
        v = qkv[:, (nq + nkv) * hd:].view(t, nkv, hd)
        q, k = rope_qk(qkv, nq, nkv, hd, cos, sin)
        attn = self.attn_backend.forward(i, q, k, v, fb, sinks=layer.sinks)
        # In place: x is this forward's own buffer (see DecoderForCausalLM.layer_forward).
        # reduce: the sum over tensor-parallel ranks' shares (identity on one rank).
        x.add_(self.reduce(self.linear(attn, layer.o_weight, layer.o_bias)))
        x.add_(self.reduce(self.moe(layer, self.norm(x, layer.post_norm))))
        return x

    def route(self, layer: GptOssLayer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] -> (expert ids [T, k], weights [T, k]): the top-k router logits, then a
        softmax over those k, in the model dtype as transformers computes them."""
        logits = layer.linear(h, layer.router_weight, layer.router_bias)
        top, ids = logits.topk(self.top_k, dim=-1)
        return ids, top.softmax(dim=-1)

    def moe(self, layer: GptOssLayer, h: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(layer, h)
        limit, alpha = self.swiglu_limit, self.swiglu_alpha

        sigmoid = row_sigmoid if layer.batch_invariant else torch.sigmoid
        pinned = layer.gate_up_bias is None  # the biases live in the fixed layers

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            gate, up = layer.linear(xs, layer.gate_up[e],
                                    None if pinned else layer.gate_up_bias[e]).chunk(2, dim=-1)
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            glu = gate * sigmoid(gate * alpha)
            return layer.linear((up + 1) * glu, layer.down[e],
                                None if pinned else layer.down_bias[e])

        if layer.batch_invariant:
            return routed_sum(h, ids, weights, self.num_experts, expert, ordered=True)
        return routed_sum(h, ids, weights, self.num_experts, expert)

    # ------------------------------------------------------------------ weight loading
    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return super().load_weight(name, tensor)  # embedding, final norm, head
        idx, sub = int(parts[2]), ".".join(parts[3:])
        for proj in _MXFP4:
            if sub in (f"{proj}_blocks", f"{proj}_scales"):
                return self._load_mxfp4(idx, proj, sub.endswith("_blocks"), tensor)
        if sub in _GGUF_EXPERTS:
            return self._load_gguf_expert(idx, sub, tensor)
        if sub not in _LAYER_NAMES:
            raise KeyError(name)
        attr, part = _LAYER_NAMES[sub]
        layer = self.layers[idx]
        key = f"layers.{idx}.{sub}"
        if part is not None:
            lo, hi = self._qkv_rows(part)
            return self._copy(getattr(layer, attr), tensor, key, name, lo, hi)
        if sub.startswith("mlp.experts."):
            tensor = self.expert_share(sub.split(".")[-1], tensor)
        if attr in ("gate_up", "down"):
            tensor = self._expert_matrix(attr, tensor)
        elif attr == "gate_up_bias":
            tensor = self._split_gate_up(tensor, dim=-1)
        return self._copy(getattr(layer, attr), tensor, key, name)

    def expert_share(self, what: str, t: torch.Tensor) -> torch.Tensor:
        """The part of a checkpoint expert tensor (`what`: gate_up_proj [E, H, 2I],
        gate_up_proj_bias, down_proj [E, I, H], down_proj_bias; MXFP4 ones once dequantized)
        this model holds: all of it (a tensor-parallel rank: its slice, tp_gpt_oss.py)."""
        return t

    def _qkv_rows(self, part: str) -> tuple[int, int]:
        d = self.dims
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}[part]

    @staticmethod
    def _split_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
        """Interleaved gate/up (gate at even indices of `dim`, up at odd) -> gate | up."""
        n = t.shape[dim]
        order = torch.cat((torch.arange(0, n, 2), torch.arange(1, n, 2))).to(t.device)
        return t.index_select(dim, order)

    def _expert_matrix(self, attr: str, t: torch.Tensor) -> torch.Tensor:
        """A checkpoint's [E, in, out] expert weights -> our [E, out, in] (gate_up split)."""
        if attr == "gate_up":
            t = self._split_gate_up(t, dim=-1)
        return t.transpose(1, 2)

    def _load_mxfp4(self, idx: int, proj: str, is_blocks: bool,
                    tensor: torch.Tensor) -> list[str]:
        """Blocks and scales arrive separately: keep the first, dequantize with the second."""
        key = f"layers.{idx}.{proj}"
        other = self._mxfp4_pending.pop(key, None)
        if other is None:
            self._mxfp4_pending[key] = tensor
            return []
        blocks, scales = (tensor, other) if is_blocks else (other, tensor)
        attr = "gate_up" if proj.endswith("gate_up_proj") else "down"
        weight = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, in, out]
        weight = self.expert_share(proj.split(".")[-1], weight)
        return self._copy(getattr(self.layers[idx], attr), self._expert_matrix(attr, weight),
                          key, f"model.{key}_blocks")

    def _load_gguf_expert(self, idx: int, sub: str, tensor: torch.Tensor) -> list[str]:
        """A GGUF expert tensor; its key is filled once both halves of gate | up are in (a
        lone half: the loader's missing-weights error names the key)."""
        attr, half = _GGUF_EXPERTS[sub]
        key, name = f"layers.{idx}.{_EXPERT_KEYS[attr]}", f"model.layers.{idx}.{sub}"
        param = getattr(self.layers[idx], attr)
        if half is None:
            return self._copy(param, tensor, key, name)
        width = param.shape[1] // 2
        dst = param.data[:, half * width:(half + 1) * width]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected "
                             f"{tuple(dst.shape)}")
        halves = self._gguf_halves.setdefault(key, set())
        if half in halves:
            raise ValueError(f"{name}: appears more than once")
        dst.copy_(tensor)
        halves.add(half)
        return [key] if len(halves) == 2 else []

    def expected_keys(self) -> set[str]:
        keys = {"embed", "final_norm"} | (set() if self.dims.tie_word_embeddings
                                          else {"lm_head"})
        for i in range(len(self.layers)):
            keys |= {f"layers.{i}.{sub}" for sub in _LAYER_NAMES}
        return keys

    def finish_load(self, loaded: list[str]) -> None:
        if self._mxfp4_pending:
            raise ValueError(f"MXFP4 weights without their other half (blocks / scales): "
                             f"{sorted(self._mxfp4_pending)[:4]}")
