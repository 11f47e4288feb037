"""Qwen3-Next's, Qwen3.5's and Qwen3.5-MoE's multi-token-prediction (MTP) layer as a draft head
(`--speculative-algorithm NEXTN`, which SGLang turns into EAGLE with the checkpoint's own MTP
layer; SGLang's Qwen3_5ForCausalLMMTP reads Qwen3.5's and Qwen3.5-MoE's under the same names).

Qwen's releases store it under `mtp.` (transformers skips those names): the zero-centred
norms `pre_fc_norm_embedding` and `pre_fc_norm_hidden`, `fc` (2H -> H), one decoder layer
`layers.0` with gated *full* attention (no Gated DeltaNet: the draft keeps K/V per token,
no recurrent state) and the MLP layer 0 of the model would have (Qwen3-Next's MoE, Qwen3.5's
dense SwiGLU, Qwen3.5-MoE's MoE block, experts one tensor per expert as released), and `norm`. Per position i
it reads the target's final-normed hidden state h_i and the next token x_{i+1}:

    x = fc(cat(norm_e(embed(x_{i+1})), norm_h(h_i)))  ->  decoder layer
    logits = lm_head(norm(x))                            (predicts x_{i+2})

On a CPU the layer's projections, MLP / experts and `fc` are packed as the target's
(hybrid_packed.py) when the target's are. The embedding and output head are the target's (`mtp_use_dedicated_embeddings` true, an
embedding of its own, is refused by name). The carry from one draft step to the next is the
normed output, as for DeepSeek's MTP layer (deepseek_mtp.py).

Under --tp-size N (runner/parallel/tp_hybrid.py) the layer is built from the rank's config, as
the target's layers: its query / KV heads and MLP width (each expert's slice), each tensor cut
to the share by the target's split (tp_hybrid_split.py reads `mtp.layers.0.*` as a
full-attention layer; fc and the norms are replicated). The embedding and head are the
target's vocabulary-parallel ones, and the attention's and MLP's partial sums are all-reduced
(the target's `reduce`, the identity on one rank).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.runner.cpu.fixed_experts import pack_block
from kvstrata.runner.cpu.packed_linear import packed_linear, replace_weight
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.gemma import gemma_rms_norm
from kvstrata.runner.models.hybrid_packed import weight_blocks
from kvstrata.runner.models.hybrid_base import WeightTable, param
from kvstrata.runner.models.qwen3_next import (Qwen3NextForCausalLM, build_layer,
                                               scale_layer_norms, zero_centred_scale)

PREFIX = "mtp."


class Qwen3NextMTPHead(WeightTable, nn.Module):
    linear = staticmethod(F.linear)  # fc's: packed_linear once packed (load_qwen3_next_mtp)

    def __init__(self, target: Qwen3NextForCausalLM, config: Any):
        super().__init__()
        layers = getattr(config, "mtp_num_hidden_layers", 1)
        if not layers:
            raise ValueError("--speculative-algorithm NEXTN: the checkpoint has no MTP layer "
                             "(mtp_num_hidden_layers is 0 in config.json)")
        if getattr(config, "mtp_use_dedicated_embeddings", False):
            raise ValueError("--speculative-algorithm NEXTN: mtp_use_dedicated_embeddings "
                             "(an MTP embedding of its own) is not built; the MTP layer "
                             "reads the target's embedding")
        self.init_weight_table()
        # Not a submodule: the target's weights are counted (and moved) once, as its own.
        self.__dict__["target"] = target
        d = target.dims  # a tensor-parallel rank's: its heads' and widths' share
        # the draft pool: one layer; the vocabulary the logits span (all-gathered under TP)
        self.dims = dataclasses.replace(d, num_layers=1, vocab_size=getattr(
            target, "full_dims", d).vocab_size)
        self.dtype, self.device = target.dtype, target.device
        kw = dict(dtype=self.dtype, device=self.device)
        h = d.hidden_size
        self.norm_embed, self.norm_hidden = param(h, **kw), param(h, **kw)
        self.fc = param(h, 2 * h, **kw)
        self.final_norm = param(h, **kw)
        # The target's config as it built its layers (Qwen3.5-MoE's normalised router
        # fields; a rank's head counts and widths under TP): the MTP layer is one of them.
        layer_config = target.config
        self.layer = build_layer(self, layer_config, d, False,
                                 target.is_moe_layer(layer_config, 0), PREFIX + "layers.0", kw)
        for name, tensor in (("pre_fc_norm_embedding", self.norm_embed),
                             ("pre_fc_norm_hidden", self.norm_hidden), ("fc", self.fc),
                             ("norm", self.final_norm)):
            self.expect(f"{PREFIX}{name}.weight", tensor)
        self.feature_size = h
        self.index_share = False  # (DeepSeek-V3.2's IndexShare: no indexer here)
        self.attn_backend = None  # the draft's own, over its one-layer K/V pool
        self.num_loaded = 0  # tensors of the MTP layer found in the checkpoint

    def skip_weight(self, name: str) -> bool:
        """The target's tensors and later MTP layers are not this head's."""
        return not name.startswith(PREFIX) or (name.startswith(PREFIX + "layers.")
                                              and not name.startswith(PREFIX + "layers.0."))

    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        split = getattr(self.target, "split", None)  # TP: cut to the rank's share
        if split is not None and not self.skip_weight(name):
            tensor = split.share(self.target, name, tensor)
        loaded = super().load_weight(name, tensor)
        self.num_loaded += len(loaded)
        return loaded

    def finish_load(self, loaded: list[str]) -> None:
        for name in ("norm_embed", "norm_hidden", "final_norm"):
            setattr(self, name, zero_centred_scale(getattr(self, name)))
        scale_layer_norms(self.layer)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, features: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`fb.input_ids[j]` is x_{i+1}, `features[j]` h_i (or the previous step's carry).
        Returns (float32 logits, normed hidden states) at fb.logits_idx."""
        t, eps = self.target, self.dims.rms_norm_eps
        self.attn_backend.init_forward_metadata(fb)
        cos, sin = t.rotary.cos_sin(fb.positions, self.dtype)
        e = gemma_rms_norm(t.embed_tokens(fb.input_ids), self.norm_embed, eps)
        hid = gemma_rms_norm(features.to(self.dtype), self.norm_hidden, eps)
        x = self.linear(torch.cat((e, hid), dim=-1), self.fc)
        layer = self.layer
        # t.reduce: under TP the rank's partial sums (its heads', its MLP width's) all-reduced
        x = x + t.reduce(t.attention(layer.mixer, 0, gemma_rms_norm(x, layer.input_norm, eps),
                                     cos, sin, fb, self.attn_backend))
        x = x + t.reduce(layer.mlp(gemma_rms_norm(x, layer.post_norm, eps)))
        if fb.logits_idx is not None:
            x = x.index_select(0, fb.logits_idx)
        x = gemma_rms_norm(x, self.final_norm, eps)
        return t.output_logits(x), x


def load_qwen3_next_mtp(source: Any, config: Any, target: Qwen3NextForCausalLM
                        ) -> Qwen3NextMTPHead:
    """The first MTP layer of `source`'s checkpoint (usually the target's own)."""
    from kvstrata.runner.models.loader import fill_mtp_layer

    if source.kind == "gguf":  # gguf_hybrid_weights.py skips the blocks past the model's
        raise ValueError(f"--speculative-algorithm NEXTN: the MTP (nextn) block of a GGUF "
                         f"file is not read ({source.display_name}); serve the safetensors "
                         f"checkpoint for NEXTN, or use NGRAM / STANDALONE")

    head = fill_mtp_layer(lambda: Qwen3NextMTPHead(target, config), source, config, target,
                          PREFIX + "*")
    if target.linear is packed_linear:  # the target's layers are packed: the draft's too
        for block in weight_blocks(SimpleNamespace(layers=[head.layer])):
            pack_block(block)
        replace_weight(head, "fc", None)
        head.linear = packed_linear
    return head


__all__ = ["Qwen3NextMTPHead", "load_qwen3_next_mtp"]
