"""GGUF weights kept quantized (`--quantization gguf`): packed linear layers built after load.

How a weight gets here: the loader yields a `PackedRows` for each quantized GGUF tensor
(runner/models/gguf_weights.py); the model's load_weight hands it, with the rows it fills of
its (possibly fused) float parameter, to `stage` instead of copying; once every tensor is in,
`replace_packed_weights` turns each parameter that got packed rows into a `GgufLinear` and
frees the float parameter (torch.empty, never written where packed rows went: its pages were
never touched, so the float copy never cost memory).

A fused weight is a list of segments side by side along the output: q|k|v or gate|up may
mix quantization types (a Q4_K_M file stores attn_v and ffn_down in Q6_K, the rest in Q4_K),
and a segment the file stored in float (F16 / F32) stays a float matrix. Adjacent segments of
one type are joined into one packed matrix (one kernel call). Each segment's matmul writes its
columns of one float32 output (runner/cpu/gguf_matmul.py takes a strided `out`), the bias is
added once, and the result is cast to the activations' dtype.

An MoE block's expert stacks ([experts, out, in]: gate|up, down) are staged per expert and
become one GgufLinear per expert in an nn.ModuleList indexed as the stack was, so the block
multiplies the tokens routed to expert e by `gate_up[e]` as it does a float stack's slice;
the block (and its shared expert) then applies its weights through gguf_linear too.

The token embedding kept packed is a GgufLinear too: a lookup dequantizes only the rows looked
up, and a tied output head multiplies the same packed rows (no second copy).

Deterministic inference (runner/quant/gguf_pinned.py): both GGUF kernels are batch-invariant,
but F.linear picks its body (and a row's summation order) by the row count, so a float
segment is multiplied by a fixed PackedLinear instead (`pin_float_segments`: kvstrata's bf16
/ fp32 GEMM at every row count; the float rows stay too, for lookups).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.runner.cpu import gguf_matmul
from kvstrata.runner.cpu.packed_linear import PackedLinear, packed_linear
from kvstrata.runner.quant.packed_rows import PackedRows

# The decoder's linear weights with the bias folded into their layer (as runner/quant/w8a8.py
# and runner/cpu/packed_linear.py replace them).
BIAS_OF = {"qkv_weight": "qkv_bias", "o_weight": "o_bias", "gate_up_weight": "gate_up_bias",
           "down_weight": "down_bias"}
_STAGED = "gguf_segments"  # the attribute a staged float parameter carries its packed rows in


def stage(param: torch.Tensor, packed: PackedRows, lo: int, hi: int,
          expert: int | None = None) -> None:
    """Rows lo..hi of `param` (a float parameter of the model) are `packed`: kept aside until
    replace_packed_weights; param's own rows there are never written. `expert`: param is an
    expert stack [experts, out, in] and the rows are that expert's (an MoE block's gate|up
    or down: each expert becomes a layer of its own)."""
    if packed.shape != (hi - lo, param.shape[-1]):
        raise ValueError(f"packed rows {packed.shape} != expected {(hi - lo, param.shape[-1])}")
    if (expert is None) != (param.dim() == 2) or (expert is not None and not
                                                   0 <= expert < param.shape[0]):
        raise ValueError(f"expert {expert} of a parameter {tuple(param.shape)}")
    if getattr(param, _STAGED, None) is None:
        setattr(param, _STAGED, [] if expert is None else {})
    staged = getattr(param, _STAGED)
    if expert is None:
        staged.append((lo, hi, packed))
    else:
        staged.setdefault(expert, []).append((lo, hi, packed))


class GgufLinear(nn.Module):
    """y = x @ W.T + b with W as segments of output rows, each GGUF blocks (multiplied packed
    by runner/cpu/gguf_matmul.py) or a float matrix."""

    def __init__(self, out_features: int, in_features: int,
                 segments: list[tuple[int, int, "PackedRows | torch.Tensor"]],
                 bias: torch.Tensor | None = None, int8_activations: bool = False):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        # gguf_matmul.matmul_q8 (8-bit activation blocks) or .matmul (float activations)
        self.int8_activations = int8_activations
        self.parts: list[tuple[int, int, Any, torch.Tensor | None]] = []
        self.nbytes = 0
        # part index -> its float segment on a fixed PackedLinear (pin_float_segments)
        self.pinned: dict[int, Any] = {}
        for lo, hi, w in _join_same_type(segments):
            if isinstance(w, PackedRows):
                self.parts.append((lo, hi, gguf_matmul.prepare(w.qtype, w.raw), w.input_perm))
                self.nbytes += w.nbytes
            else:
                self.parts.append((lo, hi, w.contiguous(), None))
                self.nbytes += w.numel() * w.element_size()
        self.bias = None if bias is None else bias.detach().float().clone()
        self.nbytes += 0 if bias is None else 4 * bias.numel()
        # One packed segment over every output and no input permutation (most layers): its
        # matmul writes the whole output, no column views (per-call overhead is a large share
        # of a batch-1 decode step's small matmuls)
        lo, hi, w, perm = self.parts[0]
        self._whole = (w if len(self.parts) == 1 and perm is None
                       and not isinstance(w, torch.Tensor) else None)

    def linear_float(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> float32 [..., out] (an output head's logits as they are)."""
        x2 = x.reshape(-1, self.in_features)
        if self._whole is not None:
            out = self._kernel()(x2, self._whole)
            if self.bias is not None:
                out.add_(self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        for i, (lo, hi, w, perm) in enumerate(self.parts):
            xs = x2 if perm is None else x2.index_select(1, perm)
            if i in self.pinned:
                out[:, lo:hi] = packed_linear(xs, self.pinned[i]).float()
            elif isinstance(w, torch.Tensor):
                out[:, lo:hi] = F.linear(xs.to(w.dtype), w).float()
            else:
                self._kernel()(xs.contiguous(), w, out=out[:, lo:hi])
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def pin_float_segments(self) -> int:
        """Deterministic inference: each float segment also as a fixed PackedLinear, which
        linear_float multiplies instead of F.linear (same dtype, same rounding of x: bf16
        rows for a bf16 segment, fp32 for fp32). Returns how many segments were pinned."""
        for i, (_, _, w, _) in enumerate(self.parts):
            if isinstance(w, torch.Tensor) and i not in self.pinned:
                self.pinned[i] = PackedLinear(w, fixed=True)
                self.nbytes += self.pinned[i].nbytes
        return len(self.pinned)

    def bound_calls(self, x: torch.Tensor, out: torch.Tensor, threads: int,
                    cap: int) -> list[tuple] | None:
        """linear_float(x) into `out` (fp32 [T, out_features], contiguous) as kernel calls with
        their pointers bound once, one per packed segment, each writing its columns: what a
        decode plan replays (runner/models/decode_plan.py), the same kernels on the same
        values as forward. None where forward does more than those calls: a float segment,
        an input permutation, a bias, or x not contiguous fp32 (the plan then runs forward)."""
        if (self.bias is not None or x.dtype != torch.float32 or not x.is_contiguous()
                or out.dtype != torch.float32 or not out.is_contiguous()
                or tuple(out.shape) != (x.shape[0], self.out_features)):
            return None
        calls = []
        for lo, _, w, perm in self.parts:
            if perm is not None or isinstance(w, torch.Tensor):
                return None
            calls.append(gguf_matmul.bound_call(x, w, out, lo, threads, cap,
                                                self.int8_activations))
        return calls

    def _kernel(self):
        return gguf_matmul.matmul_q8 if self.int8_activations else gguf_matmul.matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_float(x)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in float32 (an embedding kept packed): only those rows are
        dequantized."""
        ids = ids.reshape(-1)
        out = torch.empty(ids.numel(), self.in_features, dtype=torch.float32)
        for lo, hi, w, perm in self.parts:
            if perm is not None:
                raise ValueError("an embedding cannot have an input permutation")
            sel = ((ids >= lo) & (ids < hi)).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            local = ids.index_select(0, sel) - lo
            if isinstance(w, torch.Tensor):
                out[sel] = w.index_select(0, local).float()
            else:
                rows = gguf_matmul.prepare(w.qtype, w.raw.index_select(0, local))
                out[sel] = gguf_matmul.dequantize(rows)
        return out

    def dequantize(self) -> torch.Tensor:
        """The whole float32 matrix (what float-only consumers read: an FR-Spec head)."""
        return self.lookup(torch.arange(self.out_features))

    def extra_repr(self) -> str:
        import gguf

        kinds = [gguf.GGMLQuantizationType(w.qtype).name if not isinstance(w, torch.Tensor)
                 else str(w.dtype).replace("torch.", "") for _, _, w, _ in self.parts]
        return (f"in={self.in_features}, out={self.out_features}, segments={kinds}, "
                f"bias={self.bias is not None}")


def _join_same_type(segments: list[tuple[int, int, "PackedRows | torch.Tensor"]]
                    ) -> list[tuple[int, int, "PackedRows | torch.Tensor"]]:
    """Adjacent packed segments of one type (and no input permutation) as one."""
    out: list[tuple[int, int, PackedRows | torch.Tensor]] = []
    for lo, hi, w in sorted(segments, key=lambda s: s[0]):
        prev = out[-1] if out else None
        if (prev is not None and prev[1] == lo and isinstance(w, PackedRows)
                and isinstance(prev[2], PackedRows) and prev[2].qtype == w.qtype
                and prev[2].input_perm is None and w.input_perm is None):
            out[-1] = (prev[0], hi, PackedRows(w.qtype, torch.cat([prev[2].raw, w.raw]),
                                               w.cols))
        else:
            out.append((lo, hi, w))
    return out


def _layer_of(rows: torch.Tensor, staged: list, int8_activations: bool) -> GgufLinear:
    """A staged weight's rows ([out, in]: a parameter, or one expert of a stack) as a
    GgufLinear: its packed segments, and its float rows where the file stored that part in
    float (copied there by load_weight)."""
    segments: list[tuple[int, int, PackedRows | torch.Tensor]] = []
    at = 0
    for lo, hi, packed in sorted(staged, key=lambda s: s[0]) + [(rows.shape[0], rows.shape[0],
                                                                  None)]:
        if lo > at:  # rows the loader copied as float
            segments.append((at, lo, rows[at:lo].clone()))
        if packed is not None:
            segments.append((lo, hi, packed))
        at = hi
    return GgufLinear(rows.shape[0], rows.shape[1], segments,
                      int8_activations=int8_activations)


def _packed_of(param: torch.Tensor, int8_activations: bool) -> "GgufLinear | nn.ModuleList":
    """What a staged parameter becomes: a GgufLinear, or for an expert stack one per expert
    (indexed as the stack was: an MoE block's `self.gate_up[e]` reads either)."""
    staged = getattr(param, _STAGED)
    delattr(param, _STAGED)
    if param.dim() == 2:
        return _layer_of(param.data, staged, int8_activations)
    return nn.ModuleList(_layer_of(param.data[e], staged.get(e, []), int8_activations)
                         for e in range(param.shape[0]))


def replace_packed_weights(model: nn.Module, int8_activations: bool = False) -> dict:
    """Every parameter that got packed rows (`stage`) becomes a GgufLinear (its bias folded
    in), in every module that holds it (a tied head holds the embedding: one layer for both),
    and `model.linear` dispatches to them. int8_activations: the layers run
    gguf_matmul.matmul_q8 (a GGUF file's), else .matmul (a quantized HF checkpoint's).
    Returns what ran (for /server_info)."""
    layers: dict[int, GgufLinear | nn.ModuleList] = {}
    for module in list(model.modules()):
        for name, param in list(module._parameters.items()):
            if param is None or (id(param) not in layers
                                 and getattr(param, _STAGED, None) is None):
                continue
            if id(param) not in layers:
                layers[id(param)] = _packed_of(param, int8_activations)
                bias_name = BIAS_OF.get(name)
                bias = getattr(module, bias_name, None) if bias_name else None
                if bias is not None:
                    layers[id(param)].bias = bias.detach().float().clone()
                    layers[id(param)].nbytes += 4 * bias.numel()
                    delattr(module, bias_name)
                    setattr(module, bias_name, None)
            delattr(module, name)  # a Module cannot be assigned over a Parameter
            setattr(module, name, layers[id(param)])
            if module is not model and getattr(module, "linear", None) is F.linear:
                # a block that applies its weights with its own `linear` (an MoE block, its
                # shared expert: runner/models/moe.py) dispatches as the model does
                module.linear = gguf_linear
    model.linear = gguf_linear
    import gguf

    every = [layer for group in layers.values()
             for layer in (group if isinstance(group, nn.ModuleList) else [group])]
    qtypes = {w.qtype for layer in every for _, _, w, _ in layer.parts
              if not isinstance(w, torch.Tensor)}
    kinds = sorted(gguf.GGMLQuantizationType(q).name for q in qtypes)
    return {"quantization": "gguf", "kernel": gguf_matmul.kernel_name(),
            "activations": (gguf_matmul.activation_blocks(qtypes) if int8_activations
                            else "float32"),
            "packed_types": kinds, "packed_layers": len(every),
            "weight_bytes_packed": sum(layer.nbytes for layer in every)}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a model holds: its parameters and its packed layers, each once
    (a tied head is the embedding). What a GGUF file kept packed is compared against (its
    size: no float copy beside the blocks)."""
    params = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    packed = {id(m): m.nbytes for m in model.modules() if type(m) is GgufLinear}
    return sum(params.values()) + sum(packed.values())


def gguf_linear(x: torch.Tensor, weight: "GgufLinear | torch.Tensor",
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for F.linear(x, weight, bias) where `weight` may have become a GgufLinear (the
    decoder's bias folded in, so `bias` is None there; a recurrent hybrid's block passes its
    own); a weight the file stored in float stays one."""
    if type(weight) is GgufLinear:
        out = weight.forward(x)  # no module hooks here: skips nn.Module's call machinery
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


__all__ = ["GgufLinear", "gguf_linear", "replace_packed_weights", "stage", "weight_bytes"]
