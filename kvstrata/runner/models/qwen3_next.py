"""Qwen3-Next (Qwen3NextForCausalLM), Qwen3.5 dense (Qwen3_5ForCausalLM) and Qwen3.5-MoE
(Qwen3_5MoeForCausalLM): Gated DeltaNet
layers (gated_deltanet.py) and full-attention layers as `config.layer_types` says (3:1 in the
released models), each followed by an MLP; checked against transformers' modeling_qwen3_next
/ modeling_qwen3_5.

- RMSNorms (input, post-attention, final, q/k) scale by 1 + weight in float32, cast last:
  gemma.py's arithmetic, so the weights become 1 + w once at load (`finish_load`).
- Full attention is gated: q_proj gives per head [q | gate]; q and k are RMSNormed per head,
  rotated on the first head_dim * partial_rotary_factor dims only (rotate-half layout), and
  the attention output is multiplied by sigmoid(gate) before o_proj. Its K/V live in the
  paged KV pool, which holds only these layers.
- Qwen3.5's text rope is multimodal (mrope sections); for text every section reads the same
  position, which is plain rope.
- MLP: SwiGLU; Qwen3.5-MoE's (every layer) and Qwen3-Next's MoE layers (`decoder_sparse_step`, not `mlp_only_layers`) are
  Qwen2-MoE's block (moe_decoder.SparseMoeBlock): each token to its top-k experts by softmax
  (renormalised with norm_topk_prob) plus a shared SwiGLU expert scaled by
  sigmoid(shared_expert_gate(x)).
The MTP layer in the checkpoint (`mtp.*`) is not part of the causal LM; NEXTN drafts with it
(qwen3_next_mtp.py), reading the final-normed hidden states this model keeps with
`capture_hidden`.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.config.hf_config import ModelDims
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.gated_deltanet import GatedDeltaNet
from kvstrata.runner.models.gemma import gemma_rms_norm
from kvstrata.runner.models.hybrid_base import (FULL_ATTENTION, RECURRENT, HybridForCausalLM,
                                                param)
from kvstrata.runner.models.moe import DenseMLP, Targets
from kvstrata.runner.models.moe_decoder import STYLES, SparseMoeBlock, expert_slot
from kvstrata.runner.models.rope import RotaryEmbedding, apply_rope, rope_parameters

_KINDS = {"linear_attention": RECURRENT, "full_attention": FULL_ATTENTION}


class GatedAttention(nn.Module):
    # deterministic inference (runner/models/hybrid_fixed.py): the projections on the fixed
    # GEMM, the output gate's sigmoid position-free
    linear = staticmethod(F.linear)
    gate_sigmoid = staticmethod(torch.sigmoid)
    pinned_weights = ("qkv", "o_proj")
    pinned_expert_stacks = ()

    def __init__(self, d: ModelDims, dtype: torch.dtype, device: torch.device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        hq, hkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
        self.qkv = param((2 * hq + 2 * hkv) * hd, d.hidden_size, **kw)  # [q|gate per head, k, v]
        self.q_norm, self.k_norm = param(hd, **kw), param(hd, **kw)
        self.o_proj = param(d.hidden_size, hq * hd, **kw)

    def register(self, model, prefix: str, d: ModelDims) -> None:
        q, kv = 2 * d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        model.expect(f"{prefix}.q_proj.weight", self.qkv, (0, q))
        model.expect(f"{prefix}.k_proj.weight", self.qkv, (q, q + kv))
        model.expect(f"{prefix}.v_proj.weight", self.qkv, (q + kv, q + 2 * kv))
        for name in ("q_norm", "k_norm"):
            model.expect(f"{prefix}.{name}.weight", getattr(self, name))
        model.expect(f"{prefix}.o_proj.weight", self.o_proj)


def register_targets(model, targets: Targets, block: nn.Module | None = None,
                     expert_names: tuple[str, str, str] = ()) -> None:
    """Checkpoint name -> (our tensor, its rows) as the model's expected weights; an MoE
    `block`'s experts also name their stack and index (where GGUF blocks are staged)."""
    for name, (target, lo, hi) in targets.items():
        sub = ".".join(name.split(".")[3:])  # under model.layers.N (mtp.layers.N)
        slot = expert_slot(block, sub, expert_names) if block is not None else None
        model.expect(name, target, None if lo is None else (lo, hi), expert=slot)


def zero_centred_scale(w: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(1.0 + w.detach().float(), requires_grad=False)


def scale_layer_norms(layer: "Qwen3NextLayer") -> None:
    """A loaded layer's zero-centred norm weights w -> the float32 scales 1 + w."""
    layer.input_norm = zero_centred_scale(layer.input_norm)
    layer.post_norm = zero_centred_scale(layer.post_norm)
    if isinstance(layer.mixer, GatedAttention):
        layer.mixer.q_norm = zero_centred_scale(layer.mixer.q_norm)
        layer.mixer.k_norm = zero_centred_scale(layer.mixer.k_norm)


class Qwen3NextLayer(nn.Module):
    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden: int, dtype, device):
        super().__init__()
        self.mixer, self.mlp = mixer, mlp
        self.input_norm = param(hidden, dtype=dtype, device=device)
        self.post_norm = param(hidden, dtype=dtype, device=device)


def build_layer(owner, config: Any, dims: ModelDims, recurrent: bool, moe: bool, pre: str,
                kw: dict) -> Qwen3NextLayer:
    """One decoder layer whose checkpoint names start with `pre`, registered in `owner`'s
    weight table (the model's, or its MTP layer's)."""
    if recurrent:
        mixer = GatedDeltaNet(config, **kw)
        mixer.register(owner, f"{pre}.linear_attn")
    else:
        mixer = GatedAttention(dims, **kw)
        mixer.register(owner, f"{pre}.self_attn", dims)
    if moe:  # per expert, as released checkpoints store them
        style = STYLES["qwen3_next"]
        mlp = SparseMoeBlock(config, style, config.hidden_size, **kw)
        register_targets(owner, mlp.checkpoint_targets(f"{pre}.mlp.", style.expert_names), mlp,
                         style.expert_names)
    else:
        mlp = DenseMLP(config.hidden_size, config.intermediate_size, **kw)
        register_targets(owner, mlp.checkpoint_targets(f"{pre}.mlp."))
    layer = Qwen3NextLayer(mixer, mlp, config.hidden_size, **kw)
    owner.expect(f"{pre}.input_layernorm.weight", layer.input_norm)
    owner.expect(f"{pre}.post_attention_layernorm.weight", layer.post_norm)
    return layer


class Qwen3NextForCausalLM(HybridForCausalLM):
    grouped_in_proj = True  # Qwen3-Next's in_proj_qkvz / in_proj_ba (gated_deltanet.py)
    unsupported = ()  # deterministic inference: hybrid_fixed.py
    rope = staticmethod(apply_rope)  # hybrid_fixed.exact_rope under deterministic inference

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device):
        types = list(config.layer_types)
        if set(types) - set(_KINDS):
            raise ValueError(f"{type(self).__name__}: layer_types {types} name layers other "
                             f"than linear_attention / full_attention")
        super().__init__([_KINDS[t] for t in types], dtype, device)
        if getattr(config, "attention_bias", False):
            raise ValueError(f"{type(self).__name__}: attention_bias is not supported")
        self.config = config
        self.dims = d = ModelDims.from_config(config)
        self.eps = d.rms_norm_eps
        kw = dict(dtype=dtype, device=device)
        self.embed = param(d.vocab_size, d.hidden_size, **kw)
        self.final_norm = param(d.hidden_size, **kw)
        self.lm_head = self.embed if d.tie_word_embeddings else param(
            d.vocab_size, d.hidden_size, **kw)
        params = rope_parameters(config)
        self.rotary_dim = int(d.head_dim * float(params.get("partial_rotary_factor", 1.0)))
        self.rotary = RotaryEmbedding(self.rotary_dim, params, device)
        self.layers = nn.ModuleList(self._layer(config, i, kw) for i in range(len(types)))
        recurrent = [layer.mixer for layer in self.layers if isinstance(layer.mixer,
                                                                          GatedDeltaNet)]
        if recurrent:
            self.conv_shape, self.ssm_shape = recurrent[0].conv_shape, recurrent[0].ssm_shape
        self.expect("model.embed_tokens.weight", self.embed)
        self.expect("model.norm.weight", self.final_norm)
        if not d.tie_word_embeddings:
            self.expect("lm_head.weight", self.lm_head)
        self.capture_hidden = False  # keep last_hidden (an MTP draft's features)
        self.last_hidden: torch.Tensor | None = None

    def _layer(self, config: Any, i: int, kw: dict) -> Qwen3NextLayer:
        return build_layer(self, config, self.dims, self.kinds[i] == RECURRENT,
                           self.is_moe_layer(config, i), f"model.layers.{i}", kw)

    @staticmethod
    def is_moe_layer(config: Any, i: int) -> bool:
        experts = getattr(config, "num_experts", 0) or 0
        return (experts > 0 and i not in (getattr(config, "mlp_only_layers", None) or [])
                and (i + 1) % config.decoder_sparse_step == 0)

    def skip_weight(self, name: str) -> bool:
        return name.startswith("mtp.") or super().skip_weight(name)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        self.begin_forward(fb)
        cos, sin = self.rotary.cos_sin(fb.positions, self.dtype)
        x = self.embed_tokens(fb.input_ids)
        for i, layer in enumerate(self.layers):
            h = gemma_rms_norm(x, layer.input_norm, self.eps)
            if self.kinds[i] == RECURRENT:
                h = layer.mixer(h, self.pool_index[i], fb, self.recurrent_backend)
            else:
                h = self.attention(layer.mixer, self.pool_index[i], h, cos, sin, fb)
            x = x + self.reduce(h)
            x = x + self.reduce(layer.mlp(gemma_rms_norm(x, layer.post_norm, self.eps)))
        if self.capture_hidden:  # every token's final-normed state (the MTP's features)
            x = gemma_rms_norm(x, self.final_norm, self.eps)
            self.last_hidden = x
            if fb.logits_idx is not None:
                x = x.index_select(0, fb.logits_idx)
            return self.output_logits(x)
        if fb.logits_idx is not None:
            x = x.index_select(0, fb.logits_idx)
        return self.output_logits(gemma_rms_norm(x, self.final_norm, self.eps))

    def attention(self, attn: GatedAttention, index: int, h: torch.Tensor, cos, sin,
                  fb: ForwardBatch, backend=None) -> torch.Tensor:
        """One gated full-attention layer; its K/V in `backend`'s pool (the model's own when
        None) at layer `index` (an MTP draft runs its layer over its own pool)."""
        d = self.dims
        t, hq, hkv, hd = h.shape[0], d.num_heads, d.num_kv_heads, d.head_dim
        qkv = attn.linear(h, attn.qkv)
        q_gate = qkv[:, :2 * hq * hd].view(t, hq, 2 * hd)
        q, gate = q_gate[..., :hd], q_gate[..., hd:].reshape(t, hq * hd)
        k = qkv[:, 2 * hq * hd:(2 * hq + hkv) * hd].view(t, hkv, hd)
        v = qkv[:, (2 * hq + hkv) * hd:].view(t, hkv, hd)
        q = self._rotate(gemma_rms_norm(q, attn.q_norm, self.eps), cos, sin)
        k = self._rotate(gemma_rms_norm(k, attn.k_norm, self.eps), cos, sin)
        out = (backend or self.attn_backend).forward(index, q, k, v.contiguous(), fb)
        return attn.linear(out.reshape(t, hq * hd) * attn.gate_sigmoid(gate), attn.o_proj)

    def _rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        r = self.rotary_dim
        if r == x.shape[-1]:
            return self.rope(x, cos, sin)
        return torch.cat([self.rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def finish_load(self, loaded: list[str]) -> None:
        """The zero-centred norms' weights w become the float32 scales 1 + w (gemma.py)."""
        self.final_norm = zero_centred_scale(self.final_norm)
        for layer in self.layers:
            scale_layer_norms(layer)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's text model: the same layers, a dense MLP everywhere, Gated DeltaNet's
    projections stored separately."""
    grouped_in_proj = False

    @staticmethod
    def is_moe_layer(config: Any, i: int) -> bool:
        return False


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE's text model (Qwen3_5MoeForCausalLM): Qwen3.5's layers with Qwen3-Next's
    MoE block in every layer (softmax top-k, the k weights always renormalised: transformers'
    Qwen3_5MoeTopKRouter; a sigmoid-gated shared expert), one tensor per expert in the
    checkpoint as transformers saves them (experts.{e}.gate_proj / up_proj / down_proj)."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device):
        # the config class has no norm_topk_prob (its router always renormalises) and no
        # intermediate_size (no dense MLP; ModelDims' width, unused here, is the experts')
        config = copy.copy(config)
        config.norm_topk_prob = True
        config.intermediate_size = getattr(config, "intermediate_size", None) or \
            config.moe_intermediate_size
        super().__init__(config, dtype, device)

    @staticmethod
    def is_moe_layer(config: Any, i: int) -> bool:
        return True
