"""Mixture-of-experts members of the llama family: Qwen3-MoE, Qwen2-MoE, Mixtral and GLM-4.5
(Glm4MoeForCausalLM).

Attention, norms and rope are the llama decoder's (decoder.py: Qwen3-MoE has its per-head
q/k norms, Qwen2-MoE its q/k/v biases, Mixtral neither); only the feed-forward block of an
MoE layer differs (the `mlp` hook), as transformers' modeling_qwen3_moe / qwen2_moe / mixtral
compute it:

- router: logits = x W^T in the model dtype, softmax over all experts in float32, top k;
  the k weights renormalised to sum 1 when `norm_topk_prob` (Mixtral: always). Qwen rounds
  the weights to the model dtype, Mixtral keeps them float32.
- experts: SwiGLU each, run over the tokens routed to them, grouped by expert
  (moe.routed_sum: one gate|up and one down matmul per chosen expert per step). On the CPU
  the router, every expert and the shared experts run on kvstrata's packed linears, as the
  attention does (runner/cpu/fixed_experts.pack_moe_layers: an expert in kvstrata's bf16
  GEMM's layout alone, oneDNN's prepacked one at fp32; gate|up writes silu(gate) * up from
  its registers; KVSTRATA_CPU_PACKED_EXPERTS=0 keeps F.linear over the plain stacks).
- Qwen2-MoE adds a shared SwiGLU expert on every token, scaled by sigmoid(x w_gate).
- Qwen layers outside the sparse pattern (`mlp_only_layers`, `decoder_sparse_step`) keep a
  dense SwiGLU of `intermediate_size`; Mixtral's are all sparse.
- GLM-4.5: DeepSeek-V3's MoE block (moe.MoE: sigmoid router with e_score_correction_bias,
  group-limited top-k, routed_scaling_factor, ungated shared experts) after
  `first_k_dense_replace` dense layers; attention with q/k/v biases (attention_bias, never
  on o_proj), optional per-head q/k norms (use_qk_norm) and rotary on the first
  partial_rotary_factor of each head (rotate-half layout, so the decoder's partial rope).
Sliding windows: Mixtral / Qwen3-MoE on every layer when set, Qwen2-MoE on its
"sliding_attention" layer_types (hf_config.layer_windows, applied by the attention backend).
The fused CPU decode plan replays the dense decoder only, so these run the per-layer loop.
A GGUF file kept packed (--quantization gguf): every quantized matrix stays in its blocks --
attention and dense layers as the llama decoder's, the router and shared experts where the
file quantized them, and each expert's gate|up and down as a packed layer of its own
(runner/quant/gguf_linear.py: the stacks become one GgufLinear per expert, indexed as the
stack was, so routed_sum multiplies the tokens routed to expert e by expert e's blocks).
--quantization w8a8_int8: each expert its own int8 layer, the shared experts and attention
int8, the router and shared-expert gate float (runner/quant/w8a8.py quantize_experts). A
config field none of this builds is refused by name (moe_config.py). --tp-size N:
parallel/tp_moe.py.
--enable-deterministic-inference pins the router, every expert and the shared experts to
kvstrata's fixed GEMM (packed: their float parts; runner/quant/gguf_pinned.py) and sums
each token's experts in its own top-k order (runner/cpu/fixed_experts.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.config.hf_config import ModelDims
from kvstrata.runner.models.decoder import ArchSpec, DecoderForCausalLM, DecoderLayer, _param
from kvstrata.runner.models.moe import (SWIGLU_NAMES, DenseMLP, MoE, MoeDims, Targets,
                                        routed_sum, row_sigmoid, swiglu_of, swiglu_targets)
from kvstrata.runner.models.moe_config import check_moe_config
from kvstrata.runner.quant import gguf_linear
from kvstrata.runner.quant.packed_rows import PackedRows


@dataclass(frozen=True)
class MoeStyle:
    """How one family names and routes its experts."""
    block: str                 # the layer's MoE module: "mlp" or "block_sparse_moe"
    expert_names: tuple[str, str, str]  # gate, up, down projection names inside experts.E
    experts_field: str         # config field with the expert count
    weights_in_model_dtype: bool  # Qwen rounds the routing weights, Mixtral keeps float32


STYLES = {
    "qwen3_moe": MoeStyle("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", True),
    "qwen2_moe": MoeStyle("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", True),
    "mixtral": MoeStyle("block_sparse_moe", ("w1", "w3", "w2"), "num_local_experts", False),
    # GLM-4.5: DeepSeek-V3's MoE block (moe.MoE: sigmoid router with correction bias and
    # groups, ungated shared experts); its field names are V3's
    "glm4_moe": MoeStyle("mlp", ("gate_proj", "up_proj", "down_proj"), "n_routed_experts",
                         False),
    # Qwen3-Next's MoE layers (qwen3_next.py): Qwen2-MoE's block
    "qwen3_next": MoeStyle("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", True),
}


def moe_style(config: Any) -> MoeStyle:
    model_type = getattr(config, "model_type", None)
    if model_type not in STYLES:
        raise ValueError(f"MoE decoder: model_type {model_type!r} is not one of "
                         f"{', '.join(sorted(STYLES))}")
    return STYLES[model_type]


def sparse_layers(config: Any, num_layers: int) -> list[bool]:
    """Which layers route to experts (transformers' Qwen*MoeDecoderLayer rule; Mixtral: all)."""
    if getattr(config, "model_type", None) == "mixtral":
        return [True] * num_layers
    if getattr(config, "model_type", None) == "glm4_moe":  # transformers' Glm4MoeDecoderLayer
        return [i >= config.first_k_dense_replace for i in range(num_layers)]
    experts = int(getattr(config, "num_experts", 0) or 0)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)]


class SparseMoeBlock(nn.Module):
    """Router, routed SwiGLU experts [E, 2I, H] / [E, H, I], optional gated shared expert.

    `experts`: the routed experts this block holds ([lo, hi), all by default: a
    tensor-parallel rank holds a slice, routes over all of them and adds zeros for the
    others'); `shared_parts`: the shared expert's width is split that many ways (a rank's
    share; its sigmoid gate scales each rank's partial output, so the sum over ranks is the
    whole). As moe.MoE does for DeepSeek. Serving packs the weights the attributes below
    name (runner/cpu/fixed_experts.pack_moe_layers), deterministic inference pins them to the
    fixed GEMM (pin_moe_layers)."""
    linear = staticmethod(F.linear)
    pinned_weights = ("router", "shared_gate")
    pinned_expert_stacks = ("gate_up", "down")
    pinned_children = ("shared",)
    batch_invariant = False

    def __init__(self, config: Any, style: MoeStyle, hidden: int, dtype: torch.dtype,
                 device: torch.device, experts: tuple[int, int] | None = None,
                 shared_parts: int = 1):
        super().__init__()
        mixtral = config.model_type == "mixtral"
        e = int(getattr(config, style.experts_field))
        inter = int(config.intermediate_size if mixtral else config.moe_intermediate_size)
        self.num_experts, self.top_k, self.inter = e, int(config.num_experts_per_tok), inter
        self.norm_topk_prob = mixtral or bool(getattr(config, "norm_topk_prob", False))
        self.round_weights = style.weights_in_model_dtype
        self.experts = experts or (0, e)
        local = self.experts[1] - self.experts[0]
        kw = dict(dtype=dtype, device=device)
        self.router = _param(e, hidden, **kw)
        self.gate_up = _param(local, 2 * inter, hidden, **kw)
        self.down = _param(local, hidden, inter, **kw)
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        self.shared = (DenseMLP(hidden, shared // shared_parts, dtype, device) if shared
                       else None)
        self.shared_gate = _param(1, hidden, **kw) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k], weights [T, k])."""
        probs = torch.softmax(self.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype) if self.round_weights else weights

    def expert(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        local = e - self.experts[0]
        return self.linear(swiglu_of(self.linear, xs, self.gate_up[local]), self.down[local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = routed_sum(x, ids, weights, self.num_experts, self.expert, self.experts,
                         self.batch_invariant)
        if self.shared is not None:
            gate = self.linear(x, self.shared_gate)
            gate = row_sigmoid(gate) if self.batch_invariant else torch.sigmoid(gate)
            out = out + gate * self.shared(x)
        return out

    def checkpoint_targets(self, prefix: str, names: tuple[str, str, str]) -> Targets:
        """Names under the layer's MoE block: gate (router), experts.{e} (`names`: their
        gate, up, down projections), shared_expert and shared_expert_gate."""
        out: Targets = {f"{prefix}gate.weight": (self.router, None, None)}
        lo, hi = self.experts
        for e in range(lo, hi):
            out.update(swiglu_targets(f"{prefix}experts.{e}.", self.gate_up[e - lo],
                                      self.down[e - lo], names))
        if self.shared is not None:
            out.update(self.shared.checkpoint_targets(f"{prefix}shared_expert."))
            out[f"{prefix}shared_expert_gate.weight"] = (self.shared_gate, None, None)
        return out


def expert_slot(block: nn.Module, sub: str, names: tuple[str, str, str]
                ) -> tuple[torch.Tensor, int] | None:
    """(the expert stack, the block's index of the expert) that checkpoint name `sub` (under
    the layer: `<block>.experts.<e>.<proj>.weight`, e global) fills; None for the router,
    the shared experts and anything else."""
    parts = sub.split(".")
    if len(parts) != 5 or parts[1] != "experts" or parts[4] != "weight" or parts[3] not in names:
        return None
    stack = block.down if parts[3] == names[2] else block.gate_up
    return stack, int(parts[2]) - block.experts[0]


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """The llama decoder whose MoE layers (`layer.moe`) route to experts."""
    # The routed experts a layer holds ([lo, hi); None: all) and how many ways the shared
    # experts' width is split: a tensor-parallel rank's share (parallel/tp_moe.py).
    held_experts: tuple[int, int] | None = None
    shared_parts = 1

    def __init__(self, config: Any, spec: ArchSpec, dtype: torch.dtype, device: torch.device,
                 dims: ModelDims | None = None):
        self.style = moe_style(config)
        check_moe_config(config)  # a field we do not build is refused by name
        self.sparse = sparse_layers(config, int(config.num_hidden_layers))
        if getattr(config, "qkv_bias", None) is False:  # Qwen2-MoE's field (default True)
            spec = dataclasses.replace(spec, qkv_bias=False)
        if config.model_type == "glm4_moe":  # attention_bias: q/k/v only; optional q/k norms
            spec = dataclasses.replace(spec, qkv_bias=bool(config.attention_bias),
                                       qk_norm=bool(config.use_qk_norm))
        super().__init__(config, spec, dtype, device, dims)
        # GLM-4.5's MTP layers (checkpoint layers past num_hidden_layers): not the causal
        # LM's, as transformers skips them
        self.skip_from_layer = (self.dims.num_layers if getattr(
            config, "num_nextn_predict_layers", 0) else None)
        self._targets: dict[int, Targets] = {}

    def finish_load(self, loaded: list[str]) -> None:
        self._targets.clear()

    def make_layer(self, i: int, dims: ModelDims, spec: ArchSpec, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
        layer = DecoderLayer(dims, spec, dtype, device)
        layer.moe = None
        if self.sparse[i]:  # experts in place of the dense MLP
            layer.gate_up_weight = layer.down_weight = None
            layer.gate_up_bias = layer.down_bias = None
            layer.moe = (MoE(MoeDims.from_config(self.config), dtype, device,
                             self.held_experts, self.shared_parts)
                         if self.config.model_type == "glm4_moe" else
                         SparseMoeBlock(self.config, self.style, dims.hidden_size, dtype,
                                        device, self.held_experts, self.shared_parts))
        return layer

    def mlp(self, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        return super().mlp(layer, h) if layer.moe is None else layer.moe(h)

    # ------------------------------------------------------------------ weight loading
    def _moe_targets(self, i: int) -> Targets:
        """Checkpoint name under model.layers.i. -> (our tensor, its rows)."""
        moe, pre = self.layers[i].moe, f"{self.style.block}."
        if isinstance(moe, MoE):
            return moe.checkpoint_targets(pre)
        return moe.checkpoint_targets(pre, self.style.expert_names)

    def load_weight(self, name: str, tensor: torch.Tensor) -> list[str]:
        parts = name.split(".")
        if (self.skip_from_layer is not None and len(parts) > 3
                and parts[:2] == ["model", "layers"]
                and int(parts[2]) >= self.skip_from_layer):
            return []
        if (len(parts) > 4 and parts[:2] == ["model", "layers"]
                and self.layers[int(parts[2])].moe is not None
                and parts[3] == self.style.block):
            idx, sub = int(parts[2]), ".".join(parts[3:])
            if idx not in self._targets:  # built once per layer (18k names in a 30B-A3B)
                self._targets[idx] = self._moe_targets(idx)
            target = self._targets[idx].get(sub)
            if target is None:
                raise KeyError(name)
            param, lo, hi = target
            key = f"layers.{idx}.moe.{sub}"
            slot = expert_slot(self.layers[idx].moe, sub, self._expert_names(idx))
            if isinstance(tensor, PackedRows) and slot is not None:
                # kept packed (--quantization gguf): staged by expert on the stack itself
                # (`param` is a view of it), to become that expert's packed layer
                stack, expert = slot
                lo, hi = (0, param.shape[0]) if lo is None else (lo, hi)
                gguf_linear.stage(stack, tensor, lo, hi, expert)
                return [key]
            return self._copy(param, tensor, key, name, lo, hi)
        return super().load_weight(name, tensor)

    def _expert_names(self, i: int) -> tuple[str, str, str]:
        return (SWIGLU_NAMES if isinstance(self.layers[i].moe, MoE)
                else self.style.expert_names)

    def expected_keys(self) -> set[str]:
        keys = super().expected_keys()
        for i, layer in enumerate(self.layers):
            if layer.moe is None:
                continue
            pre = f"layers.{i}."
            keys -= {pre + "down_weight", pre + "gate_proj.weight", pre + "up_proj.weight"}
            keys |= {f"{pre}moe.{sub}" for sub in self._moe_targets(i)}
        return keys
