"""Which share of each head, group, width and vocabulary row a tensor-parallel rank of a
hybrid recurrent model holds, and each checkpoint tensor cut to it (the rules and why:
tp_hybrid.py, which builds the rank's model from `HybridSplit.local_config`)."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.runner.models.hybrid_base import (FEED_FORWARD, FULL_ATTENTION, PARALLEL,
                                                RECURRENT)
from kvstrata.runner.models.mamba2_mixer import Mamba2Shape
from kvstrata.runner.parallel.tensor_parallel import even_split, pad_rows, vocab_rows

Range = tuple[int, int]
EMBEDDINGS = ("embed_tokens.weight", "embeddings.weight", "embedding.weight")
# Layer type names of the configs (layer_types, layers_block_type, Nemotron-H's pattern).
KIND_OF = {"linear_attention": RECURRENT, "mamba": RECURRENT, "full_attention": FULL_ATTENTION,
           "attention": FULL_ATTENTION, "mlp": FEED_FORWARD, "moe": FEED_FORWARD,
           PARALLEL: PARALLEL}


def cut(t: torch.Tensor, dim: int, ranges: list[Range]) -> torch.Tensor:
    """The [lo, hi) ranges of `t` along `dim`, concatenated in order."""
    parts = [t.narrow(dim, lo, hi - lo) for lo, hi in ranges]
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim)


def scaled(r: Range, unit: int, offset: int = 0) -> Range:
    return offset + r[0] * unit, offset + r[1] * unit


def kv_head_range(nkv: int, rank: int, size: int) -> Range:
    """KV heads split, or (fewer KV heads than ranks) the one a rank's query heads read."""
    if nkv >= size:
        return even_split(nkv, rank, size, "num_key_value_heads")
    if size % nkv:
        raise ValueError(f"num_key_value_heads {nkv} must divide --tp-size {size}")
    head = rank * nkv // size
    return head, head + 1


@dataclass(frozen=True)
class MambaSplit:
    full: Mamba2Shape
    heads: Range
    groups: Range      # (0, 1) on every rank when the one group is replicated
    local: Mamba2Shape
    replicated_groups: bool

    @classmethod
    def plan(cls, full: Mamba2Shape, rank: int, size: int) -> "MambaSplit":
        heads = even_split(full.heads, rank, size, "the Mamba2 layers' num_heads")
        if full.n_groups % size == 0:
            groups = even_split(full.n_groups, rank, size, "n_groups")
        elif full.n_groups == 1:
            groups = (0, 1)
        else:
            raise ValueError(f"--tp-size {size} must divide the Mamba2 layers' n_groups "
                             f"{full.n_groups} (or n_groups be 1, replicated on every rank)")
        local = dataclasses.replace(full, heads=heads[1] - heads[0],
                                    n_groups=groups[1] - groups[0])
        return cls(full, heads, groups, local, replicated_groups=full.n_groups % size != 0)

    def conv_ranges(self, offset: int = 0) -> list[Range]:
        """x | B | C channels of this rank, in a tensor whose conv channels start at offset."""
        f, ds = self.full, self.full.d_state
        b = offset + f.intermediate
        return [scaled(self.heads, f.head_dim, offset), scaled(self.groups, ds, b),
                scaled(self.groups, ds, b + f.n_groups * ds)]

    def share(self, leaf: str, t: torch.Tensor, rank: int) -> torch.Tensor:
        f = self.full
        x = scaled(self.heads, f.head_dim)
        if leaf in ("in_proj.weight", "in_proj.bias"):  # z | x B C | dt
            dt = scaled(self.heads, 1, f.intermediate + f.conv_dim)
            return cut(t, 0, [x, *self.conv_ranges(f.intermediate), dt])
        if leaf in ("conv1d.weight", "conv1d.bias"):
            return cut(t, 0, self.conv_ranges())
        if leaf in ("dt_bias", "A_log", "D"):
            return cut(t, 0, [self.heads])
        if leaf == "norm.weight":
            return cut(t, 0, [x])
        if leaf == "out_proj.weight":
            return cut(t, 1, [x])
        if leaf == "out_proj.bias":
            return t if rank == 0 else torch.zeros_like(t)
        raise KeyError(leaf)


@dataclass(frozen=True)
class HybridSplit:
    """Which heads, groups and widths rank `rank` of `size` holds, and the config fields
    that make the model the rank builds its share (`local_fields`)."""
    rank: int
    size: int
    vocab: Range
    vocab_rows: int
    q_heads: Range | None = None         # attention (None: no attention layers)
    kv_heads: Range | None = None
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    key_heads: Range | None = None       # Gated DeltaNet
    value_heads: Range | None = None
    mamba: MambaSplit | None = None
    local_fields: tuple = ()

    def local_config(self, config: Any) -> Any:
        local = copy.copy(config)
        for name, value in self.local_fields:
            setattr(local, name, value)
        return local

    # ---- per checkpoint tensor: this rank's share
    def share(self, model: Any, name: str, t: torch.Tensor) -> torch.Tensor:
        parts = name.split(".")
        if name == "lm_head.weight" or (name.endswith(EMBEDDINGS) and parts[0] != "mtp"):
            # (an MTP layer's pre_fc_norm_embedding is a norm, replicated below)
            return pad_rows(t[self.vocab[0]:self.vocab[1]], self.vocab_rows)
        at = next((k for k in range(len(parts) - 1) if parts[k] == "layers"
                   and parts[k + 1].isdigit()), None)
        if at is None:
            return t  # the final norm; an MTP layer's fc and its norms (replicated)
        layer, module, leaf = int(parts[at + 1]), parts[at + 2], ".".join(parts[at + 3:])
        # an MTP layer (mtp.layers.0.*, NEXTN's draft) is a full-attention layer, cut as
        # the model's are (its MLP: the model's layer 0's, dense or MoE)
        kind = FULL_ATTENTION if parts[0] == "mtp" else model.kinds[layer]
        try:
            if module in ("input_layernorm", "post_attention_layernorm", "pre_ff_layernorm",
                          "norm"):
                return t
            if module == "linear_attn":
                return self._deltanet(model, leaf, t)
            if module == "self_attn" or (module == "mixer" and kind == FULL_ATTENTION):
                return self._attention(leaf, t)
            if module == "mamba" or (module == "mixer" and kind == RECURRENT):
                return self.mamba.share(leaf, t, self.rank)
            if module in ("mlp", "shared_mlp", "block_sparse_moe", "feed_forward") or (
                    module == "mixer" and kind == FEED_FORWARD):
                return self._feed_forward(leaf, t)
        except KeyError:
            pass
        raise ValueError(f"{name}: no tensor-parallel split is known for this tensor "
                         f"(--tp-size {self.size}); serve the model with --tp-size 1")

    def _deltanet(self, model: Any, leaf: str, t: torch.Tensor) -> torch.Tensor:
        cfg = model.full_config
        hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_dim = hk * dk
        if leaf in ("in_proj_qkvz.weight", "in_proj_ba.weight"):  # rows grouped per key head
            return cut(t, 0, [scaled(self.key_heads, t.shape[0] // hk)])
        if leaf in ("in_proj_qkv.weight", "conv1d.weight"):  # q | k | v
            return cut(t, 0, [scaled(self.key_heads, dk), scaled(self.key_heads, dk, key_dim),
                              scaled(self.value_heads, dv, 2 * key_dim)])
        if leaf == "in_proj_z.weight":
            return cut(t, 0, [scaled(self.value_heads, dv)])
        if leaf in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log"):
            return cut(t, 0, [self.value_heads])
        if leaf == "out_proj.weight":
            return cut(t, 1, [scaled(self.value_heads, dv)])
        if leaf == "norm.weight":  # per value head's dv: replicated
            return t
        raise KeyError(leaf)

    def _attention(self, leaf: str, t: torch.Tensor) -> torch.Tensor:
        if leaf == "q_proj.weight":  # per head: [q] or Qwen's [q | gate]
            return cut(t, 0, [scaled(self.q_heads, t.shape[0] // self.num_heads)])
        if leaf in ("k_proj.weight", "v_proj.weight"):
            return cut(t, 0, [scaled(self.kv_heads, t.shape[0] // self.num_kv_heads)])
        if leaf == "o_proj.weight":
            return cut(t, 1, [scaled(self.q_heads, self.head_dim)])
        if leaf in ("q_norm.weight", "k_norm.weight"):
            return t
        raise KeyError(leaf)

    def _feed_forward(self, leaf: str, t: torch.Tensor) -> torch.Tensor:
        parts = leaf.split(".")
        proj, what = (parts[-2], parts[-1]) if len(parts) > 1 else ("", parts[-1])
        if proj in ("gate", "shared_expert_gate", "fc1_latent_proj") or \
                leaf == "router.layer.weight":
            return t  # routers, the shared expert's gate, Nemotron-H's latent input
        if proj == "fc2_latent_proj":  # linear over the experts' partial sums
            return t if what == "weight" or self.rank == 0 else torch.zeros_like(t)
        if leaf == "experts.up_proj":  # Nemotron-H's stacks: [E, I, in], [E, in, I]
            return cut(t, 1, [even_split(t.shape[1], self.rank, self.size, leaf)])
        if leaf == "experts.down_proj":
            return cut(t, 2, [even_split(t.shape[2], self.rank, self.size, leaf)])
        if proj in ("gate_proj", "up_proj"):
            return cut(t, 0, [even_split(t.shape[0], self.rank, self.size, leaf)])
        if proj == "down_proj" and what == "weight":
            return cut(t, 1, [even_split(t.shape[1], self.rank, self.size, leaf)])
        if proj == "down_proj" and what == "bias":
            return t if self.rank == 0 else torch.zeros_like(t)
        if leaf == "input_linear.weight":  # Granite: [(E,) gate | up, H]
            dim = t.dim() - 2
            width = t.shape[dim] // 2
            m = even_split(width, self.rank, self.size, leaf)
            return cut(t, dim, [m, (width + m[0], width + m[1])])
        if leaf == "output_linear.weight":  # Granite: [(E,) H, I]
            return cut(t, t.dim() - 1, [even_split(t.shape[-1], self.rank, self.size, leaf)])
        raise KeyError(leaf)


def _width(config: Any, field: str, size: int) -> tuple[str, int]:
    value = int(getattr(config, field))
    if value % size:
        raise ValueError(f"--tp-size {size} must divide {field} {value}")
    return field, value // size


def plan_split(family: str, config: Any, full_mamba: Mamba2Shape | None,
               block_types: list[str], rank: int, size: int) -> HybridSplit:
    """The rank's share of a model of `family` (its tensor-parallel class's) whose layers are
    `block_types` (config names), or ValueError naming the field that `size` does not
    divide or what is not built."""
    kinds = [KIND_OF.get(t, t) for t in block_types]
    vocab, rows = vocab_rows(config.vocab_size, rank, size)
    fields: list[tuple[str, Any]] = [("vocab_size", rows)]
    split: dict[str, Any] = {}
    if FULL_ATTENTION in kinds or PARALLEL in kinds:
        heads = int(config.num_attention_heads)
        nkv = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        q = even_split(heads, rank, size, "num_attention_heads")
        kv = kv_head_range(nkv, rank, size)
        split.update(q_heads=q, kv_heads=kv, num_heads=heads, num_kv_heads=nkv,
                     head_dim=head_dim)
        fields += [("num_attention_heads", q[1] - q[0]), ("num_key_value_heads", kv[1] - kv[0]),
                   ("head_dim", head_dim)]  # set: some configs derive it from the heads
    if family == "qwen3_next":
        hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        if hv % hk:
            raise ValueError(f"linear_num_value_heads {hv} is not a multiple of "
                             f"linear_num_key_heads {hk}")
        key = even_split(hk, rank, size, "linear_num_key_heads")
        r = hv // hk
        split.update(key_heads=key, value_heads=(key[0] * r, key[1] * r))
        fields += [("linear_num_key_heads", hk // size), ("linear_num_value_heads", hv // size),
                   _width(config, "intermediate_size", size)]
        if getattr(config, "num_experts", 0):
            fields.append(_width(config, "moe_intermediate_size", size))
            if getattr(config, "shared_expert_intermediate_size", 0):
                fields.append(_width(config, "shared_expert_intermediate_size", size))
    elif family == "nemotron_h":
        if "mlp" in block_types:
            fields.append(_width(config, "intermediate_size", size))
        if "moe" in block_types:
            fields += [_width(config, "moe_intermediate_size", size),
                       _width(config, "moe_shared_expert_intermediate_size", size)]
    elif family == "falcon_h1":
        fields.append(_width(config, "intermediate_size", size))
    elif family == "granite_hybrid":
        if int(config.num_local_experts) > 0:
            fields.append(_width(config, "intermediate_size", size))
        fields.append(_width(config, "shared_intermediate_size", size))
    if full_mamba is not None:
        split["mamba"] = MambaSplit.plan(full_mamba, rank, size)
    return HybridSplit(rank, size, vocab, rows, local_fields=tuple(fields), **split)


__all__ = ["HybridSplit", "MambaSplit", "plan_split"]
