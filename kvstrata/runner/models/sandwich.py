"""Decoders whose sublayer outputs are normed before the residual add ("sandwich" norms), on
the llama decoder's fused weights (q|k|v and gate|up in one matrix each): OLMo 2
(Olmo2ForCausalLM) and GLM-4 (Glm4ForCausalLM). Checked against transformers'
modeling_olmo2 / modeling_glm4:

- OLMo 2: no norm before attention or MLP; attention and MLP outputs are normed
  (post_attention_layernorm, post_feedforward_layernorm) before the residual add; q and k are
  normed over the whole projection (one RMSNorm of nq * head_dim, not per head), before RoPE;
  its RMSNorm scales in float32 and casts last (llama casts, then scales).
- GLM-4: llama's two pre-norms (input_layernorm, post_attention_layernorm before the MLP)
  plus post_self_attn_layernorm / post_mlp_layernorm on the outputs; rotary over the first
  partial_rotary_factor of each head in interleaved pairs (x[2i], x[2i+1]). The loader
  reorders those rows of q and k (weights and biases alike) to the half-split layout the
  rest of kvstrata rotates: q.k is a sum over the head's dims, so the same reorder of q and k
  leaves every attention score as it was. o_proj has no bias whatever attention_bias says.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.decoder import (ArchSpec, DecoderForCausalLM, DecoderLayer,
                                            _param, rms_norm, rope_heads)
from kvstrata.runner.quant.packed_rows import PackedRows

# HF name (after "model.layers.N.") -> our parameter, per family; what is not here falls
# through to the llama names (input_layernorm, q/k/v/o_proj, gate/up/down_proj).
_NORM_NAMES = {
    "olmo2": {"post_attention_layernorm.weight": "attn_out_norm",
              "post_feedforward_layernorm.weight": "mlp_out_norm"},
    "glm4": {"post_self_attn_layernorm.weight": "attn_out_norm",
             "post_mlp_layernorm.weight": "mlp_out_norm"},
}
_OPTIONAL = ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm", "q_norm", "k_norm")


def olmo2_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """OLMo 2's RMSNorm: normalise and scale in float32, then cast."""
    if x.dtype == torch.float32:
        return rms_norm(x, weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


class SandwichLayer(DecoderLayer):
    def __init__(self, cfg, spec: ArchSpec, dtype: torch.dtype, device: torch.device):
        super().__init__(cfg, spec, dtype, device)
        kw = dict(dtype=dtype, device=device)
        h = cfg.hidden_size
        self.attn_out_norm = _param(h, **kw)
        self.mlp_out_norm = _param(h, **kw)
        if spec.family == "olmo2":
            self.input_norm = self.post_norm = None  # outputs normed, inputs not
            self.q_norm = _param(cfg.num_heads * cfg.head_dim, **kw)  # whole projection
            self.k_norm = _param(cfg.num_kv_heads * cfg.head_dim, **kw)
        else:
            self.o_bias = None  # GLM-4: attention_bias covers q, k, v only


class SandwichForCausalLM(DecoderForCausalLM):
    layer_class = SandwichLayer

    def __init__(self, config: Any, spec: ArchSpec, dtype: torch.dtype,
                 device: torch.device):
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{spec.family}: hidden_act {act!r} is not supported (silu only)")
        super().__init__(config, spec, dtype, device)
        self.norm = olmo2_rms_norm if spec.family == "olmo2" else rms_norm
        # GLM-4 rotates interleaved pairs of the first `rotary` dims of each head
        self.interleaved_rotary = self.rotary.dim if spec.family == "glm4" else 0

    def final_rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.final_norm, self.dims.rms_norm_eps)

    def layer_forward(self, i: int, layer: SandwichLayer, x: torch.Tensor,
                      cos: torch.Tensor | None, sin: torch.Tensor | None, fb: ForwardBatch,
                      input_norm: bool = True) -> torch.Tensor:
        d = self.dims
        eps, linear, norm = d.rms_norm_eps, self.linear, self.norm
        nq, nkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
        q_end, k_end = nq * hd, (nq + nkv) * hd
        t = x.shape[0]
        h = norm(x, layer.input_norm, eps) if layer.input_norm is not None else x
        qkv = linear(h, layer.qkv_weight, layer.qkv_bias)
        v = qkv[:, k_end:].view(t, nkv, hd)
        if layer.q_norm is not None:  # OLMo 2: over the whole projection, new tensors
            q = norm(qkv[:, :q_end], layer.q_norm, eps).view(t, nq, hd)
            k = norm(qkv[:, q_end:k_end], layer.k_norm, eps).view(t, nkv, hd)
            q, k = rope_heads(q, cos, sin), rope_heads(k, cos, sin)
        else:
            qk = rope_heads(qkv[:, :k_end].view(t, nq + nkv, hd), cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]
        attn = self.attn_backend.forward(i, q, k, v, fb)
        o = self.reduce(linear(attn, layer.o_weight, layer.o_bias))
        x.add_(norm(o, layer.attn_out_norm, eps))
        h = norm(x, layer.post_norm, eps) if layer.post_norm is not None else x
        gate, up = linear(h, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
        down = self.reduce(linear(F.silu(gate) * up, layer.down_weight, layer.down_bias))
        x.add_(norm(down, layer.mlp_out_norm, eps))
        return x

    # ------------------------------------------------------------------ weight loading
    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        parts = name.split(".")
        sub = ".".join(parts[3:])
        names = _NORM_NAMES[self.spec.family]
        if parts[:2] == ["model", "layers"] and sub in names:
            idx, attr = int(parts[2]), names[sub]
            return self._copy(getattr(self.layers[idx], attr), tensor,
                              f"layers.{idx}.{attr}", name)
        if self.interleaved_rotary and len(parts) > 4 and parts[4] in ("q_proj", "k_proj"):
            if isinstance(tensor, PackedRows):  # a GGUF's blocks (--quantization gguf): the
                # same reorder of whole rows
                tensor = PackedRows(tensor.qtype, deinterleave_rotary(
                    tensor.raw, self.dims.head_dim, self.interleaved_rotary), tensor.cols)
            else:
                tensor = deinterleave_rotary(tensor, self.dims.head_dim, self.interleaved_rotary)
        return super().load_weight(name, tensor)

    def expected_keys(self) -> set[str]:
        keys = super().expected_keys()
        for i, layer in enumerate(self.layers):
            pre = f"layers.{i}."
            keys |= {pre + attr for attr in _OPTIONAL if getattr(layer, attr) is not None}
            keys -= {pre + attr for attr in _OPTIONAL if getattr(layer, attr) is None}
        return keys


def deinterleave_rotary(w: torch.Tensor, head_dim: int, rotary: int) -> torch.Tensor:
    """Rows of a q or k projection (weight [heads * head_dim, in] or bias) with each head's
    first `rotary` dims moved from interleaved pairs (2i, 2i + 1) to halves (i, rotary/2 + i);
    the pass-through dims stay."""
    heads = w.shape[0] // head_dim
    rows = w.reshape(heads, head_dim, *w.shape[1:])
    rot = rows[:, :rotary].reshape(heads, rotary // 2, 2, *w.shape[1:]).transpose(1, 2)
    out = torch.cat((rot.reshape(heads, rotary, *w.shape[1:]), rows[:, rotary:]), dim=1)
    return out.reshape(w.shape).contiguous()


__all__ = ["SandwichForCausalLM", "deinterleave_rotary", "olmo2_rms_norm"]
