"""Gemma 3 (text: Gemma3ForCausalLM) and Gemma 2 (Gemma2ForCausalLM) on the llama decoder's
fused weights (q|k|v and gate|up in one matrix each, so packing and the CPU GEMMs apply).

What differs from the llama family, each checked against transformers' modeling_gemma2/3:
- RMSNorm scales by (1 + weight), in float32, and casts only after scaling (llama casts,
  then scales). The float32 (1 + w) is computed once after loading (`finish_load`), from
  norm parameters kept in float32 (a GGUF file stores the scale 1 + w itself, in float32:
  `norms_hold_scale`, and a bf16 copy of it would not be transformers' 1 + w.float()).
- Four norms per layer: input, post-attention (on the attention output, before the residual
  add), pre-feedforward and post-feedforward; Gemma 3 also norms q and k per head.
- Embeddings are multiplied by sqrt(hidden_size) rounded to the model dtype.
- GeGLU MLP: gelu (tanh approximation) of the gate times up.
- Attention scale query_pre_attn_scalar ** -0.5; `config.layer_types` gives each layer a
  window (sliding_attention) or full causal attention; Gemma 3 rotates local layers with
  their own rope base (rope_parameters["sliding_attention"]) and global layers with the
  global one (with its scaling).
- Soft-capping: final logits (both, when configured); attention logits only on Gemma 2,
  because transformers' Gemma 3 attention never passes `attn_logit_softcapping` on.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvstrata.runner.cpu import fused_ops as cpu_ops
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.decoder import (ArchSpec, DecoderForCausalLM, DecoderLayer,
                                            _param)
from kvstrata.runner.models.rope import RotaryEmbedding, apply_rope, rope_parameters

# HF norm name -> ours, beyond the llama ones DecoderForCausalLM.load_weight maps
# (input_layernorm -> input_norm, post_attention_layernorm -> post_norm, q_norm, k_norm).
_EXTRA_NORMS = {"pre_feedforward_layernorm.weight": "pre_ff_norm",
                "post_feedforward_layernorm.weight": "post_ff_norm"}
_NORMS = ("input_norm", "post_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh")


def gemma_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma RMSNorm: normalise in float32, multiply by `scale` = 1 + weight
    (float32), then cast to x's dtype. In float32 that is the llama arithmetic with weight
    (1 + w), so the fused CPU kernel serves; in bf16 the cast comes last (llama's first)."""
    if x.dtype == torch.float32:
        fused = cpu_ops.rms_norm(x, scale, eps)
        return fused if fused is not None else F.rms_norm(x, (x.shape[-1],), scale, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)


def layer_rope_parameters(config: Any, layer_type: str) -> dict:
    """One layer type's rope settings: Gemma 3 nests them per layer type in
    `rope_parameters` (transformers 5 moves rope_local_base_freq and rope_scaling there);
    Gemma 2 has one set for every layer."""
    nested = getattr(config, "rope_parameters", None) or {}
    if isinstance(nested.get(layer_type), dict):
        params = dict(nested[layer_type])
        params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
        return params
    return rope_parameters(config)


class GemmaLayer(DecoderLayer):
    def __init__(self, cfg, spec: ArchSpec, dtype: torch.dtype, device: torch.device):
        super().__init__(cfg, spec, dtype, device)
        # post_norm (from DecoderLayer) is Gemma's post_attention_layernorm: it norms the
        # attention output, not the stream entering the MLP (pre_ff_norm does that).
        self.pre_ff_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.post_ff_norm = _param(cfg.hidden_size, dtype=dtype, device=device)


class GemmaForCausalLM(DecoderForCausalLM):
    layer_class = GemmaLayer
    norms_hold_scale = False  # the loaded norm weights are w (HF), or 1 + w (GGUF: loader.py)

    def __init__(self, config: Any, spec: ArchSpec, dtype: torch.dtype,
                 device: torch.device):
        _refuse_unsupported(config)
        super().__init__(config, spec, dtype, device)
        d = self.dims
        # As transformers rounds it: sqrt(hidden) as a float32 tensor, then the model dtype.
        self.embed_scale = torch.tensor(d.hidden_size ** 0.5).to(dtype=dtype, device=device)
        layer_types = list(getattr(config, "layer_types", None) or
                           ["full_attention"] * d.num_layers)
        if len(layer_types) != d.num_layers or set(layer_types) - {"sliding_attention",
                                                                     "full_attention"}:
            raise ValueError(f"{type(self).__name__}: layer_types {layer_types} is not one of "
                             f"sliding_attention / full_attention per layer")
        self.layer_types = layer_types
        # The runner hands the attention backend self.layer_windows (set by the base class
        # from layer_types: sliding_window on "sliding_attention" layers, as transformers'
        # Gemma) and this scale of q.k.
        self.attn_scale = float(config.query_pre_attn_scalar) ** -0.5
        self.attn_softcap = (getattr(config, "attn_logit_softcapping", None)
                             if spec.attn_logit_softcapping else None)
        self.softmax_extras = self.attn_softcap is not None
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        # One rotary table per layer type (the same parameters on Gemma 2).
        self.ropes = {t: RotaryEmbedding(d.head_dim, layer_rope_parameters(config, t), device)
                      for t in sorted(set(layer_types))}
        self.rotary = None  # the base class's single table: ropes replaces it
        # Norm weights load into float32 whatever the model dtype (finish_load's scale is
        # float32 anyway, so this costs nothing after loading).
        self.final_norm = _param(d.hidden_size, dtype=torch.float32, device=device)
        for layer in self.layers:
            for attr in _NORMS:
                if getattr(layer, attr) is not None:
                    setattr(layer, attr, _param(*getattr(layer, attr).shape,
                                                dtype=torch.float32, device=device))

    @torch.inference_mode()
    @cpu_ops.fixed_settings
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """All tokens of `fb` -> float32 logits [len(fb.logits_idx), V] (every token when
        logits_idx is None). cos/sin once per layer type, shared by its layers."""
        self.attn_backend.init_forward_metadata(fb)
        rot = {t: r.cos_sin(fb.positions, self.dtype) for t, r in self.ropes.items()}
        x = self.embed_tokens(fb.input_ids)
        for i, layer in enumerate(self.layers):
            cos, sin = rot[self.layer_types[i]]
            x = self.layer_forward(i, layer, x, cos, sin, fb)
        if fb.logits_idx is not None:
            x = x.index_select(0, fb.logits_idx)  # norm + head only where logits are wanted
        return self.output_logits(gemma_rms_norm(x, self.final_norm, self.dims.rms_norm_eps))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(ids) * self.embed_scale

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().output_logits(x)
        if self.final_softcap is not None:
            cap = float(self.final_softcap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def layer_forward(self, i: int, layer: GemmaLayer, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, fb: ForwardBatch, input_norm: bool = True
                      ) -> torch.Tensor:
        d = self.dims
        eps, linear = d.rms_norm_eps, self.linear
        nq, nkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
        q_end, k_end = nq * hd, (nq + nkv) * hd
        t = x.shape[0]
        qkv = linear(gemma_rms_norm(x, layer.input_norm, eps), layer.qkv_weight,
                     layer.qkv_bias)
        v = qkv[:, k_end:].view(t, nkv, hd)
        q = qkv[:, :q_end].view(t, nq, hd)
        k = qkv[:, q_end:k_end].view(t, nkv, hd)
        if layer.q_norm is not None:
            # The norms' outputs are new tensors, rotated in place below.
            q, k = gemma_rms_norm(q, layer.q_norm, eps), gemma_rms_norm(k, layer.k_norm, eps)
            if not cpu_ops.rope_(q.view(t, -1), nq, cos, sin):
                q = apply_rope(q, cos, sin)
            if not cpu_ops.rope_(k.view(t, -1), nkv, cos, sin):
                k = apply_rope(k, cos, sin)
        elif cpu_ops.rope_(qkv, nq + nkv, cos, sin):
            pass  # rotated in place: q and k are views of qkv
        else:
            qk = apply_rope(qkv[:, :k_end].view(t, nq + nkv, hd), cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]
        attn = self._attend(i, q, k, v, fb)
        o = self.reduce(linear(attn, layer.o_weight, layer.o_bias))
        x.add_(gemma_rms_norm(o, layer.post_norm, eps))
        gate_up = linear(gemma_rms_norm(x, layer.pre_ff_norm, eps), layer.gate_up_weight,
                         layer.gate_up_bias)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") * up
        down = self.reduce(linear(act, layer.down_weight, layer.down_bias))
        x.add_(gemma_rms_norm(down, layer.post_ff_norm, eps))
        return x

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        # softcap only when configured: a backend without soft-capping is still exact then.
        if self.attn_softcap is None:
            return self.attn_backend.forward(i, q, k, v, fb)
        return self.attn_backend.forward(i, q, k, v, fb, softcap=float(self.attn_softcap))

    # ------------------------------------------------------------------ weight loading
    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        parts = name.split(".")
        sub = ".".join(parts[3:])
        if parts[:2] == ["model", "layers"] and sub in _EXTRA_NORMS:
            idx = int(parts[2])
            attr = _EXTRA_NORMS[sub]
            return self._copy(getattr(self.layers[idx], attr), tensor,
                              f"layers.{idx}.{attr}", name)
        return super().load_weight(name, tensor)

    def expected_keys(self) -> set[str]:
        keys = super().expected_keys()
        for i in range(len(self.layers)):
            keys |= {f"layers.{i}.{attr}" for attr in _EXTRA_NORMS.values()}
        return keys

    def finish_load(self, loaded: list[str]) -> None:
        """Every norm weight w becomes the float32 scale 1 + w that Gemma's RMSNorm applies
        (transformers computes it per call as 1.0 + w.float(); once here is the same); a
        GGUF file's norm weights are that scale already."""
        offset = 0.0 if self.norms_hold_scale else 1.0

        def scale(w: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(offset + w.detach().float(), requires_grad=False)

        self.final_norm = scale(self.final_norm)
        for layer in self.layers:
            for attr in _NORMS:
                if getattr(layer, attr) is not None:
                    setattr(layer, attr, scale(getattr(layer, attr)))


def _refuse_unsupported(config: Any) -> None:
    """What transformers' Gemma can do that this model does not: say so by name."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in GELU_TANH:
        raise ValueError(f"Gemma: hidden_activation {act!r} is not supported (only "
                         f"{' / '.join(GELU_TANH)}, as every released Gemma 2 / 3)")
    if getattr(config, "use_bidirectional_attention", None):
        raise ValueError("Gemma: use_bidirectional_attention (an embedding model's "
                         "attention) is not supported; kvstrata serves causal LMs")


__all__ = ["GemmaForCausalLM", "gemma_rms_norm", "layer_rope_parameters"]
