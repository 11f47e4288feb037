"""Granite-4.0-H (GraniteMoeHybridForCausalLM): Mamba2 layers (mamba2_mixer.py) and
attention layers as `config.layers_block_type` says, each followed by a top-k MoE plus a
shared SwiGLU MLP; checked against transformers' modeling_granitemoehybrid.

- Llama's RMSNorm (cast, then scale); embeddings times embedding_multiplier, each block's
  output times residual_multiplier before the residual add, logits divided by
  logits_scaling.
- Attention: q.k scaled by attention_multiplier (not 1/sqrt(head_dim)); rope only with
  position_embedding_type "rope" (Granite-4.0-H has none).
- MoE: the router's top-k logits, softmaxed among themselves, weigh SwiGLU experts
  (input_linear = gate | up, output_linear = down); num_local_experts 0 = the shared MLP only.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.config.hf_config import ModelDims
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.decoder import rms_norm
from kvstrata.runner.models.hybrid_base import (FULL_ATTENTION, RECURRENT, HybridForCausalLM,
                                                param)
from kvstrata.runner.models.mamba2_mixer import Mamba2Mixer, Mamba2Shape, time_step_limit
from kvstrata.runner.models.moe import DenseMLP, routed_sum, swiglu_of
from kvstrata.runner.models.nemotron_h import Attention
from kvstrata.runner.models.rope import RotaryEmbedding, rope_parameters

_KINDS = {"linear_attention": RECURRENT, "mamba": RECURRENT, "full_attention": FULL_ATTENTION,
          "attention": FULL_ATTENTION}


class TopKMoE(nn.Module):
    # Deterministic inference (runner/models/hybrid_fixed.py through fixed_experts.pin_block):
    # the router and every expert on the fixed GEMM; batch_invariant: silu(gate) * up per row
    # (moe.swiglu_of) and each token's experts summed in its own top-k order
    linear = staticmethod(F.linear)
    pinned_weights = ("router",)
    pinned_expert_stacks = ("gate_up", "down")
    batch_invariant = False

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts, self.top_k = e, config.num_experts_per_tok
        kw = dict(dtype=dtype, device=device)
        self.router = param(e, h, **kw)
        self.gate_up = param(e, 2 * i, h, **kw)
        self.down = param(e, h, i, **kw)

    def register(self, model, prefix: str) -> None:
        model.expect(f"{prefix}.router.layer.weight", self.router)
        model.expect(f"{prefix}.input_linear.weight", self.gate_up)
        model.expect(f"{prefix}.output_linear.weight", self.down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = self.linear(x, self.router).float().topk(self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).to(x.dtype)

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            if self.batch_invariant:
                return self.linear(swiglu_of(self.linear, xs, self.gate_up[e]), self.down[e])
            gate, up = self.linear(xs, self.gate_up[e]).chunk(2, dim=-1)
            return self.linear(F.silu(gate) * up, self.down[e])

        return routed_sum(x, ids, weights, self.num_experts, expert,
                          ordered=self.batch_invariant)


class GraniteLayer(nn.Module):
    def __init__(self, mixer: nn.Module, moe: TopKMoE | None, shared: DenseMLP, hidden: int,
                 dtype, device):
        super().__init__()
        self.mixer, self.moe, self.shared = mixer, moe, shared
        self.input_norm = param(hidden, dtype=dtype, device=device)
        self.post_norm = param(hidden, dtype=dtype, device=device)


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    unsupported = ()  # deterministic inference: hybrid_fixed.py
    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device):
        types = list(config.layers_block_type)
        if set(types) - set(_KINDS):
            raise ValueError(f"GraniteMoeHybrid: layer types {types} are not mamba / attention")
        super().__init__([_KINDS[t] for t in types], dtype, device)
        if config.attention_bias:
            raise ValueError("GraniteMoeHybrid: attention_bias is not supported")
        if config.hidden_act != "silu":
            raise ValueError(f"GraniteMoeHybrid: hidden_act {config.hidden_act!r} is not "
                             f"supported (SiLU)")
        self.config = config
        self.dims = d = ModelDims.from_config(config)
        self.eps = d.rms_norm_eps
        self.attn_scale = float(config.attention_multiplier)  # the attention backend's scale
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.residual_multiplier = float(config.residual_multiplier)
        self.logits_scaling = float(config.logits_scaling)
        self.shape = self.mamba_shape(config)
        self.conv_shape = (self.shape.conv_dim, self.shape.kernel - 1)
        self.ssm_shape = (self.shape.heads, self.shape.head_dim, self.shape.d_state)
        self.rotary = (RotaryEmbedding(d.head_dim, rope_parameters(config), device)
                       if config.position_embedding_type == "rope" else None)
        kw = dict(dtype=dtype, device=device)
        self.embed = param(d.vocab_size, d.hidden_size, **kw)
        self.final_norm = param(d.hidden_size, **kw)
        self.lm_head = self.embed if d.tie_word_embeddings else param(
            d.vocab_size, d.hidden_size, **kw)
        self.layers = nn.ModuleList(self._layer(config, i, kw) for i in range(len(types)))
        self.expect("model.embed_tokens.weight", self.embed)
        self.expect("model.norm.weight", self.final_norm)
        if not d.tie_word_embeddings:
            self.expect("lm_head.weight", self.lm_head)

    @staticmethod
    def mamba_shape(config: Any) -> Mamba2Shape:
        heads, head_dim = config.mamba_n_heads, config.mamba_d_head
        if heads * head_dim != config.mamba_expand * config.hidden_size:
            raise ValueError(f"GraniteMoeHybrid: mamba_n_heads * mamba_d_head ({heads} x "
                             f"{head_dim}) != mamba_expand * hidden_size")
        return Mamba2Shape(config.hidden_size, heads, head_dim, config.mamba_d_state,
                           config.mamba_n_groups, config.mamba_d_conv,
                           bool(config.mamba_conv_bias), bool(config.mamba_proj_bias),
                           float(config.rms_norm_eps), time_step_limit(config))

    def _layer(self, config: Any, i: int, kw: dict) -> GraniteLayer:
        pre = f"model.layers.{i}"
        if self.kinds[i] == RECURRENT:
            mixer = Mamba2Mixer(self.shape, **kw)
            mixer.register(self, f"{pre}.mamba")
        else:
            mixer = Attention(self.dims, **kw)
            mixer.register(self, f"{pre}.self_attn", self.dims)
        moe = TopKMoE(config, **kw) if config.num_local_experts > 0 else None
        if moe is not None:
            moe.register(self, f"{pre}.block_sparse_moe")
        shared = DenseMLP(config.hidden_size, config.shared_intermediate_size, **kw)
        self.expect(f"{pre}.shared_mlp.input_linear.weight", shared.gate_up)
        self.expect(f"{pre}.shared_mlp.output_linear.weight", shared.down)
        layer = GraniteLayer(mixer, moe, shared, config.hidden_size, **kw)
        self.expect(f"{pre}.input_layernorm.weight", layer.input_norm)
        self.expect(f"{pre}.post_attention_layernorm.weight", layer.post_norm)
        return layer

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        self.begin_forward(fb)
        rot = (self.rotary.cos_sin(fb.positions, self.dtype) if self.rotary is not None
               else None)
        x = self.embed_tokens(fb.input_ids) * self.embedding_multiplier
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, self.eps)
            if self.kinds[i] == RECURRENT:
                h = layer.mixer(h, self.pool_index[i], fb, self.recurrent_backend)
            else:
                h = layer.mixer(h, self.pool_index[i], fb, self.dims, self.attn_backend, rot)
            x = x + self.reduce(h) * self.residual_multiplier
            h = rms_norm(x, layer.post_norm, self.eps)
            mlp = layer.shared(h) if layer.moe is None else layer.moe(h) + layer.shared(h)
            x = x + self.reduce(mlp) * self.residual_multiplier
        if fb.logits_idx is not None:
            x = x.index_select(0, fb.logits_idx)
        return self.output_logits(rms_norm(x, self.final_norm, self.eps)) / self.logits_scaling
