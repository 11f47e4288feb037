"""Falcon-H1 (FalconH1ForCausalLM): every decoder layer runs full attention and a Mamba2 mixer
(mamba2_mixer.py) side by side on the same normed input and adds both outputs to the
residual, then a SwiGLU MLP; checked against transformers 5.25's modeling_falcon_h1 (its torch
path). Every layer is PARALLEL (hybrid_base.py): K/V pages in the KV pool and a conv window and
an SSM state in every state slot, both at the layer's own index.

- Llama's RMSNorm (cast, then scale); rope on the attention (`rope_parameters`).
- The mixer's gate meets the scan output as `mamba_rms_norm` / `mamba_norm_before_gate` say
  (Mamba2Shape.gated_norm); in_proj's bias is `mamba_proj_bias`, out_proj's
  `projectors_bias`.
- muP multipliers, each where transformers applies it:
    embedding_multiplier      the token embeddings
    attention_in_multiplier   the attention's input
    key_multiplier            the keys: folded into the attention scale (q.(m k) = m (q.k)),
                              so the paged K/V holds the keys unscaled
    attention_out_multiplier  the attention's output
    ssm_in_multiplier         the mixer's input
    ssm_multipliers           five scales of in_proj's output: gate z, x, B, C, dt
                              (transformers' mup_vector, a buffer the checkpoint lacks)
    ssm_out_multiplier        the mixer's output
    mlp_multipliers           the gate projection's output, the down projection's output
    lm_head_multiplier        the logits
Refused by name: attention_bias, mlp_bias, a hidden_act other than SiLU (the MLP's and the
mixer's conv activation), and two fields of the released config.json that transformers does not
read but that would change the layers if they meant anything else than the released value:
attn_layer_indices (null: attention in every layer) and mamba_use_mlp (true: every layer's MLP).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.config.hf_config import ModelDims
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.decoder import rms_norm
from kvstrata.runner.models.hybrid_base import PARALLEL, HybridForCausalLM, param
from kvstrata.runner.models.mamba2_mixer import Mamba2Mixer, Mamba2Shape, time_step_limit
from kvstrata.runner.models.nemotron_h import Attention
from kvstrata.runner.models.rope import RotaryEmbedding, rope_parameters
from kvstrata.runner.recurrent import pointwise


def falcon_mamba_shape(config: Any) -> Mamba2Shape:
    heads, head_dim = config.mamba_n_heads, config.mamba_d_head
    inter = config.mamba_d_ssm or int(config.mamba_expand * config.hidden_size)
    if heads * head_dim != inter:
        raise ValueError(f"FalconH1: mamba_n_heads * mamba_d_head ({heads} x {head_dim}) != "
                         f"the mixer's width {inter} (mamba_d_ssm, else mamba_expand * "
                         f"hidden_size)")
    if not config.mamba_rms_norm:
        norm = "gate_only"
    else:
        norm = "norm_then_gate" if config.mamba_norm_before_gate else "gate_then_norm"
    return Mamba2Shape(config.hidden_size, heads, head_dim, config.mamba_d_state,
                       config.mamba_n_groups, config.mamba_d_conv,
                       bool(config.mamba_conv_bias), bool(config.mamba_proj_bias),
                       float(config.rms_norm_eps), time_step_limit(config),
                       out_bias=bool(config.projectors_bias), gated_norm=norm)


def mup_vector(s: Mamba2Shape, multipliers: list[float]) -> torch.Tensor:
    """Per channel of in_proj's output (gate | x | B | C | dt) its ssm_multipliers entry."""
    if len(multipliers) != 5:
        raise ValueError(f"FalconH1: ssm_multipliers must hold 5 values (gate, x, B, C, dt), "
                         f"got {multipliers}")
    gs = s.n_groups * s.d_state
    widths = (s.intermediate, s.intermediate, gs, gs, s.heads)
    return torch.cat([torch.full((w,), float(m)) for w, m in zip(widths, multipliers)])


class FalconH1Mixer(Mamba2Mixer):
    """The Mamba2 mixer with Falcon-H1's input multiplier and per-channel in_proj scales."""

    def __init__(self, s: Mamba2Shape, in_multiplier: float, mup: torch.Tensor,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(s, dtype, device)
        self.in_multiplier = in_multiplier
        self.register_buffer("mup", mup.to(dtype=dtype, device=device), persistent=False)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.in_multiplier, self.in_proj, self.in_bias) * self.mup


class FalconMLP(nn.Module):
    """up * silu(gate * gate_multiplier), down projection times down_multiplier (gate|up
    fused into one weight: rows 0..I-1 gate, I..2I-1 up)."""
    # the fixed GEMM and a position-free SiLU once deterministic inference pinned it
    # (runner/models/hybrid_fixed.py)
    linear = staticmethod(F.linear)
    act = pointwise.TORCH
    pinned_weights = ("gate_up", "down")
    pinned_expert_stacks = ()

    def __init__(self, hidden: int, inter: int, multipliers: list[float], dtype, device):
        super().__init__()
        if len(multipliers) != 2:
            raise ValueError(f"FalconH1: mlp_multipliers must hold 2 values (gate, down), got "
                             f"{multipliers}")
        self.gate_multiplier, self.down_multiplier = (float(m) for m in multipliers)
        self.inter = inter
        self.gate_up = param(2 * inter, hidden, dtype=dtype, device=device)
        self.down = param(hidden, inter, dtype=dtype, device=device)

    def register(self, model, prefix: str) -> None:
        i = self.inter
        model.expect(f"{prefix}.gate_proj.weight", self.gate_up, (0, i))
        model.expect(f"{prefix}.up_proj.weight", self.gate_up, (i, 2 * i))
        model.expect(f"{prefix}.down_proj.weight", self.down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear(x, self.gate_up).chunk(2, dim=-1)
        return self.linear(up * self.act.silu(gate * self.gate_multiplier), self.down) \
            * self.down_multiplier


class FalconH1Layer(nn.Module):
    def __init__(self, attn: Attention, mamba: FalconH1Mixer, mlp: FalconMLP, hidden: int,
                 dtype, device):
        super().__init__()
        self.attn, self.mamba, self.mlp = attn, mamba, mlp
        self.input_norm = param(hidden, dtype=dtype, device=device)
        self.pre_ff_norm = param(hidden, dtype=dtype, device=device)


class FalconH1ForCausalLM(HybridForCausalLM):
    unsupported = ()  # deterministic inference: hybrid_fixed.py
    mamba_shape = staticmethod(falcon_mamba_shape)  # a tensor-parallel rank's: its share

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device):
        for field in ("attention_bias", "mlp_bias"):
            if getattr(config, field, False):
                raise ValueError(f"FalconH1: {field} is not supported")
        for field, released in (("attn_layer_indices", None), ("mamba_use_mlp", True)):
            if getattr(config, field, released) != released:
                raise ValueError(f"FalconH1: {field} {getattr(config, field)!r} is not "
                                 f"supported (only {released!r}: attention and the MLP in "
                                 f"every layer, as transformers builds them)")
        if config.hidden_act != "silu":
            raise ValueError(f"FalconH1: hidden_act {config.hidden_act!r} is not supported "
                             f"(SiLU)")
        super().__init__([PARALLEL] * config.num_hidden_layers, dtype, device)
        self.config = config
        self.dims = d = ModelDims.from_config(config)
        self.eps = d.rms_norm_eps
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.lm_head_multiplier = float(config.lm_head_multiplier)
        self.attention_in_multiplier = float(config.attention_in_multiplier)
        self.attention_out_multiplier = float(config.attention_out_multiplier)
        self.ssm_out_multiplier = float(config.ssm_out_multiplier)
        # the attention backend's scale: 1/sqrt(head_dim) times the keys' multiplier
        self.attn_scale = d.head_dim ** -0.5 * float(config.key_multiplier)
        self.shape = s = self.mamba_shape(config)
        self.conv_shape = (s.conv_dim, s.kernel - 1)
        self.ssm_shape = (s.heads, s.head_dim, s.d_state)
        self.rotary = RotaryEmbedding(d.head_dim, rope_parameters(config), device,
                                      getattr(config, "max_position_embeddings", None))
        kw = dict(dtype=dtype, device=device)
        self.embed = param(d.vocab_size, d.hidden_size, **kw)
        self.final_norm = param(d.hidden_size, **kw)
        self.lm_head = self.embed if d.tie_word_embeddings else param(
            d.vocab_size, d.hidden_size, **kw)
        mup = mup_vector(s, list(config.ssm_multipliers))
        self.layers = nn.ModuleList(self._layer(config, i, mup, kw)
                                    for i in range(config.num_hidden_layers))
        self.expect("model.embed_tokens.weight", self.embed)
        self.expect("model.final_layernorm.weight", self.final_norm)
        if not d.tie_word_embeddings:
            self.expect("lm_head.weight", self.lm_head)

    def _layer(self, config: Any, i: int, mup: torch.Tensor, kw: dict) -> FalconH1Layer:
        pre = f"model.layers.{i}"
        attn = Attention(self.dims, **kw)
        attn.register(self, f"{pre}.self_attn", self.dims)
        mamba = FalconH1Mixer(self.shape, float(config.ssm_in_multiplier), mup, **kw)
        mamba.register(self, f"{pre}.mamba")
        mlp = FalconMLP(config.hidden_size, config.intermediate_size,
                        list(config.mlp_multipliers), **kw)
        mlp.register(self, f"{pre}.feed_forward")
        layer = FalconH1Layer(attn, mamba, mlp, config.hidden_size, **kw)
        self.expect(f"{pre}.input_layernorm.weight", layer.input_norm)
        self.expect(f"{pre}.pre_ff_layernorm.weight", layer.pre_ff_norm)
        return layer

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        self.begin_forward(fb)
        rot = self.rotary.cos_sin(fb.positions, self.dtype)
        x = self.embed_tokens(fb.input_ids) * self.embedding_multiplier
        for i, layer in enumerate(self.layers):
            index = self.pool_index[i]  # the same in the KV pool and the state pool
            h = rms_norm(x, layer.input_norm, self.eps)
            ssm = layer.mamba(h, index, fb, self.recurrent_backend) * self.ssm_out_multiplier
            attn = layer.attn(h * self.attention_in_multiplier, index, fb, self.dims,
                              self.attn_backend, rot) * self.attention_out_multiplier
            x = x + self.reduce(ssm + attn)  # one all-reduce for both row-parallel sums
            x = x + self.reduce(layer.mlp(rms_norm(x, layer.pre_ff_norm, self.eps)))
        if fb.logits_idx is not None:
            x = x.index_select(0, fb.logits_idx)
        return self.output_logits(rms_norm(x, self.final_norm, self.eps)) \
            * self.lm_head_multiplier
