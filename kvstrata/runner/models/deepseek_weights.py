"""HF checkpoint names of DeepSeek-V2 / V3 / V3.2 (deepseek.py) -> our parameters (some
fused: gate|up).

Built once from the model's own parameters, so the loader's "every expected weight exactly
once" check covers every tensor of the model. Per-expert names (`mlp.experts.{e}.*`) are
the checkpoint format of both transformers' save_pretrained and DeepSeek's releases.
"""
from __future__ import annotations

from typing import Any

import torch

from kvstrata.runner.models.decoder import copy_weight
from kvstrata.runner.models.moe import Targets

_ATTN = {"q_proj.weight": "q_proj", "q_a_proj.weight": "q_a_proj",
         "q_a_proj.bias": "q_a_bias", "q_a_layernorm.weight": "q_a_norm",
         "q_b_proj.weight": "q_b_proj",
         "kv_a_proj_with_mqa.weight": "kv_a_proj", "kv_a_proj_with_mqa.bias": "kv_a_bias",
         "kv_a_layernorm.weight": "kv_a_norm", "kv_b_proj.weight": "kv_b_proj",
         "o_proj.weight": "o_proj", "o_proj.bias": "o_bias",
         "indexer.wq_b.weight": "index_wq_b", "indexer.wk.weight": "index_wk",
         "indexer.k_norm.weight": "index_k_norm", "indexer.k_norm.bias": "index_k_norm_bias",
         "indexer.weights_proj.weight": "index_weights_proj"}


def layer_targets(pre: str, layer: Any) -> Targets:
    """Checkpoint name -> (parameter, row range) of one decoder layer (an MTP layer too)."""
    targets: Targets = {
        pre + "input_layernorm.weight": (layer.input_norm, None, None),
        pre + "post_attention_layernorm.weight": (layer.post_norm, None, None)}
    for name, attr in _ATTN.items():
        if getattr(layer, attr) is not None:
            targets[pre + "self_attn." + name] = (getattr(layer, attr), None, None)
    return {**targets, **layer.mlp.checkpoint_targets(pre + "mlp.")}


class WeightMap:
    def __init__(self, model: Any):
        targets: Targets = {
            "model.embed_tokens.weight": (model.embed, None, None),
            "model.norm.weight": (model.final_norm, None, None)}
        if not model.dims.tie_word_embeddings:
            targets["lm_head.weight"] = (model.lm_head, None, None)
        for idx, layer in enumerate(model.layers):
            targets.update(layer_targets(f"model.layers.{idx}.", layer))
        self._targets = targets
        self._num_layers = model.dims.num_layers
        self._skip_mtp = bool(getattr(model.config, "num_nextn_predict_layers", 0))

    def load(self, name: str, tensor: torch.Tensor) -> list[str]:
        target = self._targets.get(name)
        if target is None:
            if self._skip_mtp and self._is_mtp_layer(name):
                return []  # multi-token-prediction layers: not part of the causal LM
            raise KeyError(name)
        param, lo, hi = target
        return copy_weight(param, tensor, name, name, lo, hi)

    def _is_mtp_layer(self, name: str) -> bool:
        parts = name.split(".")
        return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and int(parts[2]) >= self._num_layers)

    def expected_keys(self) -> set[str]:
        return set(self._targets)
