"""DeepSeek's multi-token-prediction (MTP) layer as a draft head (`--speculative-algorithm
NEXTN`, which SGLang turns into EAGLE with the checkpoint's own MTP layer).

The checkpoint stores it as layer `num_hidden_layers` (one per `num_nextn_predict_layers`;
kvstrata drafts with the first, as SGLang does): `enorm`, `hnorm`, `eh_proj`, one decoder
layer of the target's kind (MLA, with the DSA indexer on V3.2; MoE or dense MLP) and
`shared_head.norm`.
Per position i it reads the target's final-normed hidden state h_i and the *next* token
x_{i+1}, like an EAGLE head:

    x = eh_proj(cat(enorm(embed(x_{i+1})), hnorm(h_i)))  ->  decoder layer
    logits = lm_head(shared_head.norm(x))                  (predicts x_{i+2})

The embedding and output head are the target's own (`embed_tokens` and `shared_head.head`
in the MTP layer are copies of them in DeepSeek's releases and are not loaded). The layer's
KV (latent, + indexer key on V3.2) lives in the draft's own MLA pool over the target's slots; the
carry from one draft step to the next is the normed output (what SGLang's NEXTN model
returns as its hidden states).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.runner.cpu.packed_linear import packed_linear, replace_weight
from kvstrata.runner.forward_batch import ForwardBatch
from kvstrata.runner.models.decoder import copy_weight, rms_norm
from kvstrata.runner.models.deepseek import DeepseekForCausalLM, DeepseekLayer, _param
from kvstrata.runner.models.deepseek_packed import pack_mla_layer
from kvstrata.runner.models.deepseek_weights import layer_targets

# Tensors of the MTP layer that the target's own replace (SGLang shares them).
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_layer_type(config: Any, num_layers: int) -> str:
    """The MTP layer's MLP: MoE where layer `num_layers` would be (DeepSeek-V3: MoE)."""
    types = getattr(config, "mlp_layer_types", None)
    if types and len(types) > num_layers:
        return types[num_layers]
    return "sparse" if num_layers >= getattr(config, "first_k_dense_replace", 0) else "dense"


class DeepseekMTPHead(nn.Module):
    def __init__(self, target: DeepseekForCausalLM, config: Any):
        super().__init__()
        if not getattr(config, "num_nextn_predict_layers", 0):
            raise ValueError("--speculative-algorithm NEXTN: the checkpoint has no MTP layer "
                             "(num_nextn_predict_layers is 0 or missing in config.json)")
        d = target.dims
        # Not a submodule: the target's weights are counted (and moved) once, as its own.
        self.__dict__["target"] = target
        self.layer_index = d.num_layers
        self.dims = dataclasses.replace(
            d, mlp_layer_types=d.mlp_layer_types + (mtp_layer_type(config, d.num_layers),))
        self.dtype, self.device = target.dtype, target.device
        kw = dict(dtype=self.dtype, device=self.device)
        h = d.hidden_size
        self.enorm = _param(h, **kw)
        self.hnorm = _param(h, **kw)
        self.eh_proj = _param(h, 2 * h, **kw)
        self.shared_norm = _param(h, **kw)
        self.layer = DeepseekLayer(self.dims, d.num_layers, self.dtype, self.device)
        self.feature_size = h
        # IndexShare: draft steps reuse the draft-extend's top-k (config flag, SGLang's name).
        self.index_share = bool(getattr(config, "index_share_for_mtp_iteration", False))
        if self.index_share and not d.uses_dsa:
            raise ValueError(f"--speculative-algorithm NEXTN: index_share_for_mtp_iteration "
                             f"is true but {target.arch} has no DSA indexer whose top-k the "
                             f"MTP layer could share")
        self.num_loaded = 0  # tensors of the MTP layer found in the checkpoint
        self.attn_backend = None  # the draft's DSASparseMLABackend (its own pool, 1 layer)
        self._targets = self._weight_targets()

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, features: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`fb.input_ids[j]` is x_{i+1}, `features[j]` h_i (or the previous step's carry).
        Returns (float32 logits, normed hidden states) at fb.logits_idx."""
        t, eps = self.target, self.dims.rms_norm_eps
        self.attn_backend.init_forward_metadata(fb)
        cos, sin = t.rope_cos_sin(fb)
        e = rms_norm(F.embedding(fb.input_ids, t.embed), self.enorm, eps)
        hid = rms_norm(features.to(self.dtype), self.hnorm, eps)
        x = t.linear(torch.cat((e, hid), dim=-1), self.eh_proj)
        x = t.layer_forward(self.layer, 0, x, cos, sin, fb, self.attn_backend)
        if fb.logits_idx is not None:
            x = x.index_select(0, fb.logits_idx)
        x = rms_norm(x, self.shared_norm, eps)
        return t.linear(x, t.lm_head).float(), x

    # ------------------------------------------------------------------ weight loading
    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, int | None, int | None]]:
        pre = f"model.layers.{self.layer_index}."
        out = {pre + "enorm.weight": (self.enorm, None, None),
               pre + "hnorm.weight": (self.hnorm, None, None),
               pre + "eh_proj.weight": (self.eh_proj, None, None),
               pre + "shared_head.norm.weight": (self.shared_norm, None, None)}
        return {**out, **layer_targets(pre, self.layer)}

    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Loads the MTP layer's tensors; other names (the target's, later MTP layers) are
        not the draft's and return []."""
        pre = f"model.layers.{self.layer_index}."
        if not name.startswith(pre) or name[len(pre):] in _SHARED:
            return []
        if name not in self._targets:
            raise KeyError(name)
        param, lo, hi = self._targets[name]
        self.num_loaded += 1
        return copy_weight(param, tensor, name, name, lo, hi)

    def expected_keys(self) -> set[str]:
        return set(self._targets)


def load_mtp_head(source: Any, config: Any, target: DeepseekForCausalLM) -> DeepseekMTPHead:
    """The first MTP layer of `source`'s checkpoint (usually the target's own)."""
    from kvstrata.runner.models.loader import fill_mtp_layer

    head = fill_mtp_layer(lambda: DeepseekMTPHead(target, config), source, config, target,
                          f"model.layers.{target.dims.num_layers}.*, although its config.json "
                          f"says num_nextn_predict_layers "
                          f"{getattr(config, 'num_nextn_predict_layers', 0)}")
    if target.linear is packed_linear:  # the target's layers are packed: the draft's too
        pack_mla_layer(head.layer, head.dims, target.packed_linears)
        replace_weight(head, "eh_proj", None)
    return head


__all__ = ["DeepseekMTPHead", "load_mtp_head", "mtp_layer_type"]
