"""Nemotron-H (NemotronHForCausalLM) and Mamba2 (Mamba2ForCausalLM): pre-norm residual blocks
whose mixer is a Mamba2 layer (mamba2_mixer.py), and for Nemotron-H also full attention or a
feed-forward layer, as `config.layers_block_type` says (the checkpoint's
hybrid_override_pattern: M mamba, * attention, - MLP, E MoE); checked against transformers'
modeling_nemotron_h / modeling_mamba2.

- Nemotron-H's attention has no positional encoding (no rope): q.k / sqrt(head_dim) over the
  attention layers' K/V in the paged KV pool (which holds only those layers). Its MLP is
  up -> relu^2 -> down. Its RMSNorm multiplies by the weight in float32 and casts last
  (gemma.py's arithmetic with the weight itself as the scale).
- Mamba2's RMSNorm is llama's (cast, then scale); with residual_in_fp32 the residual stream
  stays in float32 and each block's norm reads it in the model dtype.
- Nemotron-H's MoE layers (block type "moe", E in the pattern): nemotron_h_moe.py, a
  feed-forward layer (nothing kept per request).
Checkpoints name the model `backbone.*` (transformers' `model.*` is read the same way).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.config.hf_config import ModelDims
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.decoder import rms_norm
from kvstrata.runner.models.gemma import gemma_rms_norm
from kvstrata.runner.models.hybrid_base import (FEED_FORWARD, FULL_ATTENTION, RECURRENT,
                                                HybridForCausalLM, param)
from kvstrata.runner.models.mamba2_mixer import Mamba2Mixer, Mamba2Shape, mamba2_shape
from kvstrata.runner.models.nemotron_h_moe import NemotronHMoE
from kvstrata.runner.models.rope import apply_rope

_KINDS = {"linear_attention": RECURRENT, "mamba": RECURRENT, "full_attention": FULL_ATTENTION,
          "attention": FULL_ATTENTION, "mlp": FEED_FORWARD, "moe": FEED_FORWARD}


class Attention(nn.Module):
    """q|k|v fused, no bias; rope only when the caller passes cos / sin (Granite's option)."""
    linear = staticmethod(F.linear)  # the fixed GEMM once pinned (hybrid_fixed.py)
    rope = staticmethod(apply_rope)  # hybrid_fixed.exact_rope once pinned
    pinned_weights = ("qkv", "o_proj")
    pinned_expert_stacks = ()

    def __init__(self, d: ModelDims, dtype: torch.dtype, device: torch.device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.qkv = param((d.num_heads + 2 * d.num_kv_heads) * d.head_dim, d.hidden_size, **kw)
        self.o_proj = param(d.hidden_size, d.num_heads * d.head_dim, **kw)

    def register(self, model, prefix: str, d: ModelDims) -> None:
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        model.expect(f"{prefix}.q_proj.weight", self.qkv, (0, q))
        model.expect(f"{prefix}.k_proj.weight", self.qkv, (q, q + kv))
        model.expect(f"{prefix}.v_proj.weight", self.qkv, (q + kv, q + 2 * kv))
        model.expect(f"{prefix}.o_proj.weight", self.o_proj)

    def forward(self, h: torch.Tensor, index: int, fb: ForwardBatch, d: ModelDims, backend,
                rot: tuple | None = None) -> torch.Tensor:
        t, hq, hkv, hd = h.shape[0], d.num_heads, d.num_kv_heads, d.head_dim
        qkv = self.linear(h, self.qkv)
        q = qkv[:, :hq * hd].view(t, hq, hd)
        k = qkv[:, hq * hd:(hq + hkv) * hd].view(t, hkv, hd)
        v = qkv[:, (hq + hkv) * hd:].view(t, hkv, hd)
        if rot is not None:
            q, k = self.rope(q, *rot), self.rope(k, *rot)
        out = backend.forward(index, q, k, v, fb)
        return self.linear(out.reshape(t, hq * hd), self.o_proj)


class ReluSquaredMLP(nn.Module):
    linear = staticmethod(F.linear)  # the fixed GEMM once pinned (hybrid_fixed.py)
    pinned_weights = (("up", "up_bias"), ("down", "down_bias"))
    pinned_expert_stacks = ()

    def __init__(self, hidden: int, inter: int, bias: bool, dtype, device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.up, self.down = param(inter, hidden, **kw), param(hidden, inter, **kw)
        self.up_bias = param(inter, **kw) if bias else None
        self.down_bias = param(hidden, **kw) if bias else None

    def register(self, model, prefix: str) -> None:
        for name, target in (("up_proj.weight", self.up), ("down_proj.weight", self.down),
                             ("up_proj.bias", self.up_bias),
                             ("down_proj.bias", self.down_bias)):
            if target is not None:
                model.expect(f"{prefix}.{name}", target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(F.relu(self.linear(x, self.up, self.up_bias)).square(), self.down,
                           self.down_bias)


class Block(nn.Module):
    def __init__(self, mixer: nn.Module, hidden: int, dtype, device):
        super().__init__()
        self.mixer = mixer
        self.norm = param(hidden, dtype=dtype, device=device)


class NemotronHForCausalLM(HybridForCausalLM):
    residual_in_fp32 = False
    unsupported = ()  # deterministic inference: hybrid_fixed.py

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device):
        types = list(self.block_types(config))
        unknown = sorted(set(types) - set(_KINDS))
        if unknown:
            raise ValueError(f"{type(self).__name__}: block types {unknown} are not supported "
                             f"(Mamba2, attention, MLP and MoE layers are)")
        super().__init__([_KINDS[t] for t in types], dtype, device)
        self.block_type_names = types
        self.config = config
        self.dims = d = self.model_dims(config)
        self.eps = float(config.layer_norm_epsilon)
        self.shape = self.mamba_shape(config)
        kw = dict(dtype=dtype, device=device)
        self.embed = param(d.vocab_size, d.hidden_size, **kw)
        self.final_norm = param(d.hidden_size, **kw)
        self.lm_head = self.embed if d.tie_word_embeddings else param(
            d.vocab_size, d.hidden_size, **kw)
        self.layers = nn.ModuleList(self._block(config, i, kw) for i in range(len(types)))
        self.conv_shape = (self.shape.conv_dim, self.shape.kernel - 1)
        self.ssm_shape = (self.shape.heads, self.shape.head_dim, self.shape.d_state)
        self.expect("backbone.embeddings.weight", self.embed)
        self.expect("backbone.norm_f.weight", self.final_norm)
        if not d.tie_word_embeddings:
            self.expect("lm_head.weight", self.lm_head)

    @staticmethod
    def block_types(config: Any) -> list[str]:
        return config.layers_block_type

    @staticmethod
    def model_dims(config: Any) -> ModelDims:
        heads = config.num_attention_heads
        return ModelDims(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers, num_heads=heads,
            num_kv_heads=config.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size, rms_norm_eps=float(config.layer_norm_epsilon),
            tie_word_embeddings=bool(config.tie_word_embeddings), attention_bias=False,
            mlp_bias=bool(getattr(config, "mlp_bias", False)))

    @staticmethod
    def mamba_shape(config: Any) -> Mamba2Shape:
        return mamba2_shape(config, config.mamba_hidden_act, config.mamba_num_heads,
                            config.mamba_head_dim, config.ssm_state_size)

    def _block(self, config: Any, i: int, kw: dict) -> Block:
        pre = f"backbone.layers.{i}"
        kind = self.kinds[i]
        if kind == RECURRENT:
            mixer = Mamba2Mixer(self.shape, **kw)
            mixer.register(self, f"{pre}.mixer")
        elif kind == FULL_ATTENTION:
            mixer = Attention(self.dims, **kw)
            mixer.register(self, f"{pre}.mixer", self.dims)
        elif self.block_type_names[i] == "moe":
            shared = ReluSquaredMLP(config.hidden_size,
                                    config.moe_shared_expert_intermediate_size,
                                    bool(config.mlp_bias), **kw)
            mixer = NemotronHMoE(config, shared, **kw)
            mixer.register(self, f"{pre}.mixer")
        else:
            if config.mlp_hidden_act != "relu2":
                raise ValueError(f"Nemotron-H: mlp_hidden_act {config.mlp_hidden_act!r} is "
                                 f"not supported (relu2)")
            mixer = ReluSquaredMLP(config.hidden_size, config.intermediate_size,
                                   bool(config.mlp_bias), **kw)
            mixer.register(self, f"{pre}.mixer")
        block = Block(mixer, config.hidden_size, **kw)
        self.expect(f"{pre}.norm.weight", block.norm)
        return block

    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        if name.startswith("model."):  # transformers' module name for the backbone
            name = "backbone." + name[len("model."):]
        # state-spaces' Mamba2 checkpoints: "embedding" (transformers' load hook renames it)
        name = name.replace("backbone.embedding.", "backbone.embeddings.")
        if ".mixer.experts." in name or name.endswith((".experts.up_proj",
                                                         ".experts.down_proj")):
            i = int(name.split(".")[2])
            mixer = self.layers[i].mixer
            got = (mixer.load_expert(f"backbone.layers.{i}.mixer", name, tensor)
                   if isinstance(mixer, NemotronHMoE) else None)
            if got is not None:
                return got
        return super().load_weight(name, tensor)

    def expected_keys(self) -> set[str]:
        keys = super().expected_keys()
        for i, block in enumerate(self.layers):
            if isinstance(block.mixer, NemotronHMoE):
                keys |= block.mixer.expert_keys(f"backbone.layers.{i}.mixer")
        return keys

    def skip_weight(self, name: str) -> bool:
        return name.startswith("mtp.") or super().skip_weight(name)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, weight, self.eps)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        self.begin_forward(fb)
        x = self.embed_tokens(fb.input_ids)
        if self.residual_in_fp32:
            x = x.float()
        for i, block in enumerate(self.layers):
            h = self.norm(x.to(self.dtype), block.norm)
            kind = self.kinds[i]
            if kind == RECURRENT:
                h = block.mixer(h, self.pool_index[i], fb, self.recurrent_backend)
            elif kind == FULL_ATTENTION:
                h = block.mixer(h, self.pool_index[i], fb, self.dims, self.attn_backend)
            else:
                h = block.mixer(h)
            x = x + self.reduce(h)
        if fb.logits_idx is not None:
            x = x.index_select(0, fb.logits_idx)
        return self.output_logits(self.norm(x.to(self.dtype), self.final_norm))

    def finish_load(self, loaded: list[str]) -> None:
        """Nemotron-H scales by its norm weights in float32 (gemma_rms_norm's scale)."""
        def scale(w: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(w.detach().float(), requires_grad=False)

        self.final_norm = scale(self.final_norm)
        for block in self.layers:
            block.norm = scale(block.norm)


class Mamba2ForCausalLM(NemotronHForCausalLM):
    """Every block a Mamba2 mixer; no KV pool at all (pool kind "none")."""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__(config, dtype, device)
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", False))

    @staticmethod
    def block_types(config: Any) -> list[str]:
        return ["mamba"] * config.num_hidden_layers

    @staticmethod
    def model_dims(config: Any) -> ModelDims:
        # No attention: heads only fill the shape (nothing reads them).
        return ModelDims(
            hidden_size=config.hidden_size, intermediate_size=int(config.expand
                                                                  * config.hidden_size),
            num_layers=config.num_hidden_layers, num_heads=1, num_kv_heads=1, head_dim=1,
            vocab_size=config.vocab_size, rms_norm_eps=float(config.layer_norm_epsilon),
            tie_word_embeddings=bool(config.tie_word_embeddings), attention_bias=False,
            mlp_bias=False)

    @staticmethod
    def mamba_shape(config: Any) -> Mamba2Shape:
        if config.num_heads * config.head_dim != int(config.expand * config.hidden_size):
            raise ValueError(f"Mamba2: num_heads * head_dim ({config.num_heads} x "
                             f"{config.head_dim}) != expand * hidden_size")
        return mamba2_shape(config, config.hidden_act, config.num_heads, config.head_dim,
                            config.state_size)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)  # Mamba2RMSNorm: llama's arithmetic

    def finish_load(self, loaded: list[str]) -> None:
        pass
