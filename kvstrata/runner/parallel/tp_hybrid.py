"""One rank's share of a hybrid recurrent model under --tp-size N: Qwen3.5 and Qwen3-Next
(Gated DeltaNet), Nemotron-H, Mamba2, Granite-4.0-H and Falcon-H1 (Mamba2), split as vLLM's
Qwen3NextGatedDeltaNet / MambaMixer2 and SGLang split them:

- Gated DeltaNet: a rank holds linear_num_key_heads / N key heads and the value heads that
  read them (value heads i*r .. i*r + r - 1 belong to key head i, so both ranges are
  contiguous): its rows of q, k, v, z, b, a in in_proj, its q / k / v channels of the conv,
  its value heads' dt_bias / A_log, and out_proj's matching input columns (row-parallel:
  the partial outputs are all-reduced). The gated RMSNorm is per value head: nothing
  crosses ranks. Its state slot holds its heads' conv channels and SSM states only.
- Mamba2: a rank holds num_heads / N heads (their z, x and dt rows of in_proj, x channels
  of the conv, dt_bias / A_log / D, norm weight, out_proj columns). n_groups (B and C): split
  when N divides it (head h reads group h // (heads / n_groups), so a rank's heads read its
  own groups), replicated on every rank when it is 1, else refused. The gated group RMSNorm
  normalises over a group's channels: whole on each rank when the groups are split; with the
  one group replicated it spans every rank and its mean square is averaged over the ranks
  (mamba2_mixer.py `norm_ranks`, vLLM's Mixer2RMSNormGated). out_proj's bias: rank 0.
- Attention layers: query heads split, KV heads split or replicated as tensor_parallel.py
  does; Qwen's gated q_proj keeps [q | gate] per head, so a head's rows stay together.
- MLPs (SwiGLU, relu^2) and MoE experts (Qwen3-Next's, Granite's, Nemotron-H's): the width
  split (gate / up rows, down columns; every rank holds every expert's slice, as
  tp_gpt_oss.py); routers and the shared expert's sigmoid gate replicated (the gate scales
  each rank's partial sum); Nemotron-H's latent projections replicated (the output one is
  linear over the experts' partial sums, its bias on rank 0); a down bias added by rank 0.
- The embedding and LM head are vocabulary-parallel (tensor_parallel.py).
Each rank builds the model from a config whose head counts and widths are its share
(tp_hybrid_split.py `local_config`); checkpoint tensors are read whole and cut to the share in load_weight (the
fused ones, in_proj_qkv, conv1d, Mamba2's in_proj, are several row ranges). Norms, q/k norms,
rotary tables and the conv kernel are replicated. A tensor this file has no rule for is an
error, never loaded whole. Falcon-H1's parallel layers sum the attention's and the mixer's
partial outputs in one all-reduce; its per-channel in_proj multipliers follow the local
shape (falcon_h1.mup_vector).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvstrata.config.hf_config import ModelDims
from kvstrata.runner.models.falcon_h1 import FalconH1ForCausalLM
from kvstrata.runner.models.granite_hybrid import GraniteMoeHybridForCausalLM
from kvstrata.runner.models.hybrid_base import PARALLEL
from kvstrata.runner.models.mamba2_mixer import Mamba2Mixer, Mamba2Shape
from kvstrata.runner.models.nemotron_h import Mamba2ForCausalLM, NemotronHForCausalLM
from kvstrata.runner.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3NextForCausalLM
from kvstrata.runner.parallel.tensor_parallel import TPGroup, vocab_parallel_embed
from kvstrata.runner.parallel.tp_hybrid_split import HybridSplit, plan_split


class TPHybrid:
    """The tensor-parallel pieces over a hybrid model class (MRO: this, then the model):
    built from the rank's local config, the vocabulary-parallel ends, the all-reduce after
    every row-parallel projection, and load_weight cutting each tensor to the rank's share."""
    family = ""

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device,
                 group: TPGroup):
        self.group, self.full_config = group, config
        self.split = type(self).plan(config, group.rank, group.size)
        super().__init__(self.split.local_config(config), dtype, device)
        base = super()
        self.full_dims = dataclasses.replace(
            base.model_dims(config) if hasattr(base, "model_dims")
            else ModelDims.from_config(config), vocab_size=config.vocab_size)
        if self.split.mamba is not None and self.split.mamba.replicated_groups:
            for layer in self.layers:
                for mixer in layer.modules():
                    if isinstance(mixer, Mamba2Mixer):
                        mixer.norm_ranks = group

    @classmethod
    def plan(cls, config: Any, rank: int, size: int) -> HybridSplit:
        """Rank `rank`'s share of the model `config` describes (the model class's own
        Mamba2 shape and layer types, before anything is built)."""
        base = super(TPHybrid, cls)
        full_mamba = base.mamba_shape(config) if hasattr(base, "mamba_shape") else None
        return plan_split(cls.family, config, full_mamba, list(cls.block_type_names_of(config)),
                          rank, size)

    @staticmethod
    def block_type_names_of(config: Any) -> list[str]:
        """The config's layer type names (each family's own field)."""
        return config.layer_types

    def mamba_shape(self, config: Any) -> Mamba2Shape:
        return self.split.mamba.local

    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        if self.skip_weight(name):
            return []
        return super().load_weight(name, self.split.share(self, name, tensor))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embed(self.group, ids, self.embed, *self.split.vocab)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(partial)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x, self.lm_head).float()  # packed or int8 (hybrid_packed.py)
        return self.group.all_gather_last(local)[:, :self.full_dims.vocab_size]


class TPQwen3Next(TPHybrid, Qwen3NextForCausalLM):
    family = "qwen3_next"


class TPQwen3_5(TPHybrid, Qwen3_5ForCausalLM):
    family = "qwen3_next"


class TPNemotronH(TPHybrid, NemotronHForCausalLM):
    family = "nemotron_h"
    block_type_names_of = staticmethod(NemotronHForCausalLM.block_types)


class TPMamba2(TPHybrid, Mamba2ForCausalLM):
    family = "mamba2"
    block_type_names_of = staticmethod(Mamba2ForCausalLM.block_types)


class TPGraniteHybrid(TPHybrid, GraniteMoeHybridForCausalLM):
    family = "granite_hybrid"

    @staticmethod
    def block_type_names_of(config: Any) -> list[str]:
        return config.layers_block_type


class TPFalconH1(TPHybrid, FalconH1ForCausalLM):
    family = "falcon_h1"

    @staticmethod
    def block_type_names_of(config: Any) -> list[str]:
        return [PARALLEL] * config.num_hidden_layers


TP_CLASSES = {"Qwen3NextForCausalLM": TPQwen3Next, "Qwen3_5ForCausalLM": TPQwen3_5,
              "NemotronHForCausalLM": TPNemotronH, "Mamba2ForCausalLM": TPMamba2,
              "GraniteMoeHybridForCausalLM": TPGraniteHybrid,
              "FalconH1ForCausalLM": TPFalconH1}


def tp_class(name: str, size: int) -> type:
    """The tensor-parallel class of hybrid architecture `name`, or ValueError naming it."""
    if name not in TP_CLASSES:
        raise ValueError(f"--tp-size {size}: tensor parallelism is not built for {name} (it "
                         f"is for {', '.join(sorted(TP_CLASSES))}); serve it at --tp-size 1")
    return TP_CLASSES[name]


def tp_hybrid_model(name: str, config: Any, dtype: torch.dtype, device: torch.device,
                    group: TPGroup):
    """Rank `group.rank`'s share of hybrid architecture `name` (unfilled: the loader fills
    it through load_weight)."""
    return tp_class(name, group.size)(config, dtype, device, group)


__all__ = ["TPHybrid", "TP_CLASSES", "tp_class", "tp_hybrid_model"]
