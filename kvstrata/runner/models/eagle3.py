"""An EAGLE-3 draft head: HF checkpoints of `LlamaForCausalLMEagle3` form (SGLang's
`--speculative-algorithm EAGLE3`).

Its feature at position i is three of the target's hidden states at i (the residual stream
entering layers 2, L // 2 and L - 3, or the checkpoint's `eagle_aux_hidden_state_layer_ids`
+ 1), concatenated and projected by `fc` (3 H_target -> H). The one decoder layer
("midlayer") reads cat(input_layernorm(embed(x_{i+1})), hidden_norm(h)) -- 2 H wide into
its q/k/v -- with h as its residual; then a final norm and the head's own output matrix
over a draft vocabulary, whose index j is target token j + d2t[j]. A draft step feeds the
layer's pre-norm output (H wide, no fc) back as h, as SGLang does. The embedding is the
target's (SGLang's set_embed), so a checkpoint's `embed_tokens` is not used; `t2d` neither.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.decoder import (ArchSpec, DecoderForCausalLM, DecoderLayer,
                                            ModelDims, _param, rms_norm)
from kvstrata.runner.models.rope import RotaryEmbedding, apply_rope, rope_parameters

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)


def aux_layers(draft_config: Any, target_layers: int) -> list[int]:
    """Target layers whose *input* residual stream the head reads, ascending."""
    eagle = getattr(draft_config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    layers = ([i + 1 for i in ids] if ids else
              [2, target_layers // 2, target_layers - 3])
    if len(set(layers)) != 3 or not all(0 <= i < target_layers for i in layers):
        raise ValueError(f"--speculative-draft-model-path: EAGLE3 aux layers {layers} do not "
                         f"fit a target of {target_layers} layers")
    return sorted(layers)


class Eagle3Head(DecoderForCausalLM):
    def __init__(self, config: Any, target: DecoderForCausalLM, dtype: torch.dtype,
                 device: torch.device):
        nn.Module.__init__(self)
        self.config = config
        self.spec = ArchSpec()
        self.dims = dims = ModelDims.from_config(config)
        if dims.num_layers != 1:
            raise ValueError(f"--speculative-draft-model-path: an EAGLE3 head has one layer, "
                             f"this one {dims.num_layers}")
        h, th = dims.hidden_size, target.dims.hidden_size
        if getattr(config, "target_hidden_size", None) not in (None, th):
            raise ValueError(f"--speculative-draft-model-path: the EAGLE3 head was trained for "
                             f"hidden size {config.target_hidden_size}, the target has {th}")
        self.dtype, self.device = dtype, device
        kw = dict(dtype=dtype, device=device)
        self.layers = nn.ModuleList([DecoderLayer(dims, self.spec, dtype, device)])
        layer = self.layers[0]
        layer.qkv_weight = _param((dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim,
                                  2 * h, **kw)  # q/k/v read [embedding, hidden]
        self.hidden_norm = _param(h, **kw)
        self.final_norm = _param(h, **kw)
        self.fc_weight = _param(h, 3 * th, **kw)
        self.fc_bias: nn.Parameter | None = _param(h, **kw)
        self.draft_vocab = getattr(config, "draft_vocab_size", None) or dims.vocab_size
        self.lm_head = _param(self.draft_vocab, h, **kw)
        self.hot_ids = torch.arange(self.draft_vocab, device=device)  # d2t applied on load
        self.rotary = RotaryEmbedding(dims.head_dim, rope_parameters(config), device)
        self.attn_backend = None
        self.linear = F.linear
        self.capture_hidden = False
        # the target's lookup (not a parameter of the head): F.embedding over its matrix, or
        # the rows of an embedding kept in GGUF blocks (runner/quant/gguf_linear.py)
        self.embed_of_target = (target.embed_tokens,)
        self.vocab_size = target.dims.vocab_size
        self.feature_size = 3 * th

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, features: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like EagleHead.forward; `features` are 3 H_target wide (the target's aux
        states: through fc) or H wide (a draft step's carry)."""
        d, linear = self.dims, self.linear
        nq, nkv, hd = d.num_heads, d.num_kv_heads, d.head_dim
        q_end, k_end = nq * hd, (nq + nkv) * hd
        self.attn_backend.init_forward_metadata(fb)
        cos, sin = self.rotary.cos_sin(fb.positions, self.dtype)
        emb = self.embed_of_target[0](fb.input_ids)
        h = features.to(emb.dtype)
        if h.shape[-1] != d.hidden_size:
            h = linear(h, self.fc_weight, self.fc_bias)
        layer = self.layers[0]
        t = h.shape[0]
        a_in = torch.cat([rms_norm(emb, layer.input_norm, d.rms_norm_eps),
                          rms_norm(h, self.hidden_norm, d.rms_norm_eps)], dim=-1)
        qkv = linear(a_in, layer.qkv_weight, layer.qkv_bias)
        qk = apply_rope(qkv[:, :k_end].view(t, nq + nkv, hd), cos, sin)
        attn = self.attn_backend.forward(0, qk[:, :nq], qk[:, nq:],
                                         qkv[:, k_end:].view(t, nkv, hd), fb)
        x = h + linear(attn, layer.o_weight, layer.o_bias)  # the residual: h, then attention
        gate, up = linear(rms_norm(x, layer.post_norm, d.rms_norm_eps), layer.gate_up_weight,
                          layer.gate_up_bias).chunk(2, dim=-1)
        x = x + linear(F.silu(gate) * up, layer.down_weight, layer.down_bias)
        if fb.logits_idx is not None:
            x = x.index_select(0, fb.logits_idx)
        draft = linear(rms_norm(x, self.final_norm, d.rms_norm_eps), self.lm_head).float()
        logits = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.hot_ids] = draft
        return logits, x

    # ------------------------------------------------------------------ weight loading
    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "t2d"):
            return []
        if name == "d2t":
            ids = tensor.to(torch.int64) + torch.arange(tensor.shape[0])
            if tensor.shape[0] != self.draft_vocab or int(ids.max()) >= self.vocab_size:
                raise ValueError(f"EAGLE3 d2t: {tensor.shape[0]} entries mapping up to "
                                 f"{int(ids.max())} for a draft vocabulary of "
                                 f"{self.draft_vocab} and a target of {self.vocab_size}")
            self.hot_ids = ids.to(self.device)
            return ["d2t"]
        simple = {"fc.weight": self.fc_weight, "fc.bias": self.fc_bias,
                  "norm.weight": self.final_norm, "lm_head.weight": self.lm_head,
                  "midlayer.hidden_norm.weight": self.hidden_norm}
        if name in simple:
            return self._copy(simple[name], tensor, name, name)
        if name.startswith("midlayer."):
            return super().load_weight("model.layers.0." + name.removeprefix("midlayer."),
                                       tensor)
        raise KeyError(name)

    def expected_keys(self) -> set[str]:
        keys = super().expected_keys() - {"embed", "final_norm", "lm_head"}
        return keys | {"fc.weight", "norm.weight", "lm_head.weight",
                       "midlayer.hidden_norm.weight"}

    def finish_load(self, loaded: list[str]) -> None:
        if "fc.bias" not in loaded:
            self.fc_bias = None
        if "d2t" not in loaded and self.draft_vocab != self.vocab_size:
            raise ValueError("EAGLE3 head: a draft vocabulary smaller than the target's needs "
                             "its d2t map")
