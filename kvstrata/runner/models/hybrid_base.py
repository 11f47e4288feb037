"""What the hybrid recurrent models (qwen3_next.py: Qwen3-Next, Qwen3.5; nemotron_h.py:
Nemotron-H, Mamba2) share: the runner-facing surface, their KV and state components, and a
weight table.

Layers come in kinds: full attention (K/V per token in the paged KV pool, through the
attention backend at the layer's index among the attention layers: the pool holds those
layers only), recurrent (a conv window and an SSM state per request in the state pool,
kv/state_pool.py, through the recurrent backend at the layer's index among the recurrent
layers), for Nemotron-H feed-forward-only layers that keep nothing, and for Falcon-H1
parallel layers (attention and a Mamba2 mixer side by side on the same input: the layer has
K/V pages in the KV pool and a state in every state slot, at the same index in both pools).

The weight table (`WeightTable`, also Qwen3-Next's MTP layer's) maps each checkpoint name to
the parameter (or the rows of a fused one) it fills, so `load_weight` / `expected_keys` are one lookup; a transform may reorder rows first
(Qwen3-Next's per-key-head interleaved in_proj_qkvz).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.config.kv_plan import KVComponent, mha_components
from kvstrata.config.state_plan import STATE_CONV, STATE_SSM, StateComponent
from kvstrata.runner.quant import gguf_linear
from kvstrata.runner.quant.packed_rows import PackedRows
from kvstrata.runner.recurrent.backend import RecurrentBackend

FULL_ATTENTION = "full_attention"
RECURRENT = "recurrent"
FEED_FORWARD = "feed_forward"
PARALLEL = "parallel"          # both FULL_ATTENTION and RECURRENT (Falcon-H1)


def param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: the loader fills every parameter (checked against the weight table).
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightTable:
    """Checkpoint name -> the parameter (or rows of a fused one) it fills: `expect` while
    building, then `load_weight` / `expected_keys` are one lookup each (the loader's
    contract). A hybrid model and Qwen3-Next's MTP layer keep one."""

    def init_weight_table(self) -> None:
        self._weights: dict[str, tuple] = {}

    def expect(self, name: str, target: torch.Tensor, rows: tuple[int, int] | None = None,
               transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
               expert: tuple[torch.Tensor, int] | None = None) -> None:
        """Checkpoint tensor `name` fills `target` (its rows lo..hi when given), after
        `transform` when given. `expert`: target is expert e of a stack, (stack, e) -- where
        block rows kept packed are staged (stage_packed)."""
        self._weights[name] = (target, rows, transform, expert)

    def skip_weight(self, name: str) -> bool:
        """Checkpoint tensors this model does not use (an MTP head's, a vision tower's)."""
        return False

    def read_spec(self, name: str) -> Any:
        return None if self.skip_weight(name) else "all"

    def load_weight(self, name: str, tensor: "torch.Tensor | PackedRows | list") -> list[str]:
        if self.skip_weight(name):
            return []
        if name not in self._weights:
            raise KeyError(f"{type(self).__name__} has no parameter for it")
        target, rows, transform, expert = self._weights[name]
        if isinstance(tensor, (PackedRows, list)):  # a GGUF's blocks (--quantization gguf)
            stage_packed(target, rows, transform, tensor, expert)
            return [name]
        if transform is not None:
            tensor = transform(tensor)
        dst = target.data if rows is None else target.data[rows[0]:rows[1]]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected "
                             f"{tuple(dst.shape)}")
        dst.copy_(tensor)
        return [name]

    def expected_keys(self) -> set[str]:
        return set(self._weights)


def stage_packed(target: torch.Tensor, rows: tuple[int, int] | None,
                 transform: Callable | None, packed: "PackedRows | list",
                 expert: tuple[torch.Tensor, int] | None = None) -> None:
    """Block rows kept packed for `target` (its rows when given), staged to become a
    GgufLinear after the load (gguf_linear.stage): `transform` moves the block rows as it
    would a float tensor's (only row transforms meet packed weights: gguf_hybrid_weights.py
    dequantizes the rest); a list is a whole expert stack, one PackedRows per expert; an
    expert's rows (`expert`: its stack and index) stage on the stack."""
    if isinstance(packed, list):
        for e, expert in enumerate(packed):
            gguf_linear.stage(target, expert, 0, target.shape[1], e)
        return
    if transform is not None:
        packed = PackedRows(packed.qtype, transform(packed.raw), packed.cols)
    lo, hi = rows or (0, target.shape[0])
    if expert is not None:
        gguf_linear.stage(expert[0], packed, lo, hi, expert[1])
    else:
        gguf_linear.stage(target, packed, lo, hi)


class HybridForCausalLM(WeightTable, nn.Module):
    """Subclasses set `kinds` (one of FULL_ATTENTION / RECURRENT / FEED_FORWARD / PARALLEL
    per layer),
    `dims` (the attention layers' heads for the attention backend; vocab size), the
    recurrent layers' state shapes (`conv_shape`, `ssm_shape`), build their layers and
    register every weight with `expect`."""
    # The runner's KV pool kind: "mha" with attention layers, "none" without (Mamba2).
    pool_kind = "mha"
    layer_windows = None       # no sliding windows (the runner caps nothing)
    # not packed_linear.pack_model's decoder layout: hybrid_packed.py packs these models
    packable = False
    # Not built for these models yet (model_setup refuses them by name); deterministic
    # inference is built for the classes hybrid_fixed.PINNED_CLASSES names.
    unsupported = ("--enable-deterministic-inference",)
    # the output head's: packed (hybrid_packed.py), int8 (hybrid_w8a8.py) or fixed once pinned
    linear = staticmethod(F.linear)

    def __init__(self, kinds: list[str], dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.kinds = kinds
        self.dtype, self.device = dtype, device
        # Per layer its index in its pool (attention: the KV pool; recurrent: the state pool;
        # a parallel layer: the same index in both, which holds while every attention layer
        # before it is parallel too, as in Falcon-H1).
        counts = {FULL_ATTENTION: 0, RECURRENT: 0, FEED_FORWARD: 0}
        self.pool_index: list[int] = []
        for i, kind in enumerate(kinds):
            if kind == PARALLEL:
                if counts[FULL_ATTENTION] != counts[RECURRENT]:
                    raise ValueError(f"{type(self).__name__}: parallel layer {i} after "
                                     f"attention-only or recurrent-only layers is not built")
                self.pool_index.append(counts[RECURRENT])
                counts[FULL_ATTENTION] += 1
                counts[RECURRENT] += 1
                continue
            self.pool_index.append(counts[kind])
            counts[kind] += 1
        self.num_attention_layers = counts[FULL_ATTENTION]
        self.num_recurrent_layers = counts[RECURRENT]
        if not self.num_attention_layers:
            self.pool_kind = "none"
        self.attn_backend = None                       # set by the runner (needs the KV pool)
        self.recurrent_backend = RecurrentBackend(None)  # the runner's, over its state pool
        self.conv_shape: tuple[int, ...] = ()
        self.ssm_shape: tuple[int, ...] = ()
        self.init_weight_table()

    def skip_weight(self, name: str) -> bool:
        """Checkpoint tensors this model does not use (a tied head's copy; subclasses add an
        MTP head's, a vision tower's)."""
        return name == "lm_head.weight" and self.dims.tie_word_embeddings

    # ------------------------------------------------------------------ pool geometry
    def kv_components(self) -> tuple[KVComponent, ...]:
        """K/V per token of the full-attention layers only (none for an all-recurrent model)."""
        if not self.num_attention_layers:
            return ()
        d = self.dims
        return mha_components(self.num_attention_layers, d.num_kv_heads, d.head_dim,
                              dtype_name(self.dtype))

    def state_components(self, ssm_dtype: str = "float32") -> tuple[StateComponent, ...]:
        """Per state slot and recurrent layer: the conv window in the model dtype and the SSM
        state in `ssm_dtype` (float32 by default, as SGLang's --mamba-ssm-dtype)."""
        n = self.num_recurrent_layers
        return (StateComponent(STATE_CONV, n, self.conv_shape, dtype_name(self.dtype)),
                StateComponent(STATE_SSM, n, self.ssm_shape, ssm_dtype))

    # ------------------------------------------------------------------ forward pieces
    # A tensor-parallel rank (runner/parallel/tp_hybrid.py) overrides these three: its
    # vocabulary rows, its heads' partial outputs summed over ranks.
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output (a mixer's out_proj, an MLP's down): whole on
        one rank."""
        return partial

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.lm_head).float()

    def begin_forward(self, fb) -> None:
        if self.num_attention_layers:
            self.attn_backend.init_forward_metadata(fb)
