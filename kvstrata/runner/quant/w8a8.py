"""`--quantization w8a8_int8` on CPU: int8 linear layers, applied once after the weights load.

Scheme (SGLang's w8a8_int8): int8 weights with one symmetric scale per output channel, and
int8 activations with one scale per token, computed on the fly. Every linear layer is
replaced, the output projection included; a tied embedding stays float for the lookup (the
output projection then gets its own int8 copy).

Kernel with VNNI: runner/cpu/int8_linear.py in the model's dtype (chosen by `int8_kernel`):
kvstrata's own int8 GEMM on AVX512-VNNI (runner/cpu/csrc/int8_gemm.h), oneDNN's prepacked int8
linear otherwise. Without VNNI on AVX2 + FMA + F16C: kvstrata's own GEMM on its AVX2 tile
(runner/cpu/csrc/int8_gemm_avx2.h; 8-bit activations, the same values as the VNNI tile). Else
(or KVSTRATA_CPU_INT8_MM=0, KVSTRATA_CPU_INT8_GEMM=onednn without VNNI): fbgemm through
`quantized::linear_with_input_q_dq_qweight_dq_output_fp32` (int8 GEMM, int32 accumulation,
float32 out). Measured in benchmarks/bench_int8_linear.py against float32 `nn.Linear`,
fbgemm's `linear_dynamic` and torchao 0.18 (docs/benchmarks.md): torchao's CPU int8 path
goes through `torch._int_mm` / an int32 matmul and ran at 0.15-1.4x float32's
speed (fbgemm: 1.6-12x), so torchao is not used. fbgemm quantises its input with ONE scale
per call; per-token scales are obtained by dividing each row by its absolute maximum first
(every row then spans [-1, 1], quantised with the fixed scale 1/127) and multiplying the
output rows back. A fixed input scale also makes each token's result independent of the
other tokens in the batch, which fbgemm's own dynamic op (a scale from the whole batch's
range) is not.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
from torch import nn

import torch.nn.functional as F

from kvstrata import envs
from kvstrata.platform import VNNI_FLAGS, read_cpu_flags
from kvstrata.runner.cpu import int8_linear, packed_linear as packed
from kvstrata.runner.cpu.fixed_experts import pack_block
from kvstrata.runner.cpu.int8_linear import Int8MatmulLinear, cpu_weight_shape
from kvstrata.runner.cpu.packed_linear import PackedLinear
from kvstrata.runner.quant.gguf_linear import GgufLinear
from kvstrata.runner.quant.smoothing import smooth_model

QUANTIZATION_METHODS = ("w8a8_int8",)
KERNEL = "fbgemm quantized::linear_with_input_q_dq_qweight_dq_output_fp32, per-token row scaling"


@functools.lru_cache(maxsize=1)
def cpu_has_vnni() -> bool:
    """AVX512-VNNI / AVX-VNNI accumulate u8*s8 products in int32. Without them fbgemm uses
    vpmaddubsw, whose int16 pair sums can saturate with full 8-bit inputs: then activations
    keep 7 bits (fbgemm's own `reduce_range` remedy)."""
    return bool(VNNI_FLAGS & read_cpu_flags())


def _quantize_weight(weight: torch.Tensor) -> tuple[Any, int]:
    """fbgemm-packed int8 weight (symmetric, per output channel) and its size in bytes."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_(min=1e-12).double()
    zeros = torch.zeros(w.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():
        # torch marks quantized tensors deprecated; they are still fbgemm's only entry point.
        warnings.simplefilter("ignore", UserWarning)
        qw = torch.quantize_per_channel(w, scales, zeros, axis=0, dtype=torch.qint8)
    # Size: the packed int8 matrix plus per-channel scale, zero point and column offsets
    # (process RSS grew by ~1.1x the int8 size per packed 196608 x 576 matrix: block padding).
    return torch.ops.quantized.linear_prepack(qw, None), w.numel() + 20 * w.shape[0]


class W8A8Int8Linear(nn.Module):
    """y = x @ W.T + b with W in int8 (per-channel scales) and x quantised per token."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = cpu_weight_shape(weight)
        self.packed, self.nbytes = _quantize_weight(weight)
        self.bias = None if bias is None else bias.detach().float().clone()
        if self.bias is not None:
            self.nbytes += self.bias.numel() * 4
        # Each row spans [-1, 1] after scaling: quantised to +-levels around levels + 1,
        # so the uint8 codes stay in [1, 255] (or [1, 127] with 7 bits).
        self.levels = 127 if cpu_has_vnni() else 63

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:
            return self.linear_2d(x)
        y = self.linear_2d(x.reshape(-1, self.in_features).float())
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def linear_2d(self, x: torch.Tensor) -> torch.Tensor:
        """[M, in] float32 -> [M, out] float32. Few ops on purpose: at decode (M = batch)
        each op's fixed cost is comparable to the int8 GEMM itself."""
        amax = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            x / amax, 1.0 / self.levels, self.levels + 1, self.packed)
        return y.mul_(amax) if self.bias is None else torch.addcmul(self.bias, y, amax)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def quantized_linear(x: torch.Tensor, layer: "W8A8Int8Linear | Int8MatmulLinear",
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for F.linear(x, weight, bias) where `weight` has become an int8 layer (its
    bias, if any, was folded in, so `bias` is None). Skips nn.Module.__call__ (and, for the
    fbgemm layer's 2-D float32 input, the reshapes); the decoder's own calls (2-D contiguous
    rows, kvstrata's GEMM) go straight to the C call: 121 calls a decode step, ~0.3-0.5 ms
    of Python frames saved a step (SmolLM2, A/B in one process)."""
    if (type(layer) is Int8MatmulLinear and x.dim() == 2 and x.shape[0] <= layer.own_max_rows
            and x.dtype in int8_linear.ROW_DTYPES and x.is_contiguous()):
        return layer.own_rows(x, x.shape[0], layer.in_features, False)
    if type(layer) is W8A8Int8Linear and x.dim() == 2 and x.dtype == torch.float32:
        return layer.linear_2d(x)
    return layer.forward(x)


def int8_kernel() -> tuple[Callable[..., nn.Module], str]:
    """The int8 layer this CPU runs (its class, or a per-weight choice) and its kernel's
    name: with VNNI runner/cpu/int8_linear.py (kvstrata's own GEMM on AVX512-VNNI, else oneDNN's
    prepacked int8 linear); without, kvstrata's GEMM on its AVX2 tile where a weight fits,
    else (or with KVSTRATA_CPU_INT8_MM=0 / KVSTRATA_CPU_INT8_GEMM=onednn) fbgemm (7-bit
    activations)."""
    if int8_linear.available(cpu_has_vnni()):
        return Int8MatmulLinear, int8_linear.kernel_name()
    if int8_linear.avx2_gemm_available():
        return avx2_or_fbgemm, int8_linear.OWN_AVX2_KERNEL
    return W8A8Int8Linear, KERNEL


def avx2_or_fbgemm(weight: torch.Tensor, bias: torch.Tensor | None = None
                   ) -> "Int8MatmulLinear | W8A8Int8Linear":
    """Without VNNI: kvstrata's GEMM (AVX2 tile, 8-bit activations) where its layout takes
    the weight (an output width off its 16-column tiles padded with zero rows), else fbgemm's
    layer (7-bit activations: oneDNN's would saturate)."""
    out_features, in_features = cpu_weight_shape(weight)
    if (int8_linear.own_gemm_fits(in_features, out_features)
            or int8_linear.padded_width(in_features, out_features) is not None):
        return Int8MatmulLinear(weight, bias)
    return W8A8Int8Linear(weight, bias)


# The decoder's float weights that are linear layers: (weight attribute, bias attribute).
_LAYER_LINEARS = (("qkv_weight", "qkv_bias"), ("o_weight", "o_bias"),
                  ("gate_up_weight", "gate_up_bias"), ("down_weight", "down_bias"))


def mixed_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """F.linear(x, weight, bias) over a block or model whose weights are of three kinds once
    quantized: int8 layers (the experts, projections), float ones kept float (a router,
    Qwen2-MoE's shared-expert gate, DSA's indexer) as PackedLinears or plain tensors."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    if isinstance(weight, PackedLinear):
        return packed.packed_linear(x, weight, bias)
    return quantized_linear(x, weight, bias)


# The MoE blocks' weights that stay float (runner/models/moe.py MoE, moe_decoder.py
# SparseMoeBlock): the router, whose logits choose experts (an int8 error there flips a
# near-tied top-k choice, and a token then gets another expert's whole output rather than
# one expert's int8 noise; SGLang's w8a8_int8 keeps its MoE gate unquantized too), and
# Qwen2-MoE's shared-expert gate (one output column). Both are [E or 1, hidden]: a few KiB
# beside the experts' MiB, so int8 would save nothing measurable.
ROUTING_WEIGHTS = ("router", "shared_gate")


def quantize_experts(block: nn.Module, layer_cls: Callable[..., nn.Module], fixed: bool,
                     pack_float: bool) -> int:
    """An MoE block (or a dense SwiGLU block of the same kind, moe.DenseMLP) in place: every
    routed expert its own int8 layer (an nn.ModuleList indexed as the stack was, so the
    tokens grouped for expert e run expert e's int8 GEMM: moe.routed_sum), the shared
    experts int8, ROUTING_WEIGHTS float -- on kvstrata's packed GEMM where `pack_float`, on
    its fixed one where `fixed` (deterministic inference: the int8 GEMM is batch-invariant
    as it stands, and the block then runs its per-row sigmoid and ordered combine). Returns
    how many weights became int8 layers."""
    made = 0

    def make(name, weight, bias, pinned, expert):
        nonlocal made
        if name not in ROUTING_WEIGHTS:
            made += 1
            return layer_cls(weight, bias)
        if pinned or pack_float:
            return PackedLinear(weight, bias, fixed=pinned)
        if bias is not None:
            raise ValueError(f"{type(block).__name__}.{name}: a bias beside a float routing "
                             f"weight is not built")
        return weight

    pack_block(block, fixed, mixed_linear, make)
    return made


def float_packing(model: nn.Module) -> bool:
    """The weights kept float are packed as the float model's would be
    (KVSTRATA_CPU_PACKED_LINEAR, packed_linear.available)."""
    return envs.KVSTRATA_CPU_PACKED_LINEAR.get() and packed.available(model)


def replace_with_int8(owner: nn.Module, weight_name: str, bias_name: str | None,
                      layer_cls: Callable[..., nn.Module]) -> None:
    """owner.<weight_name> (and its bias, whose attribute becomes None) -> an int8 layer."""
    weight = getattr(owner, weight_name)
    bias = getattr(owner, bias_name) if bias_name else None
    q = layer_cls(weight, bias)
    # Drop the float registrations first: a Module cannot be assigned over a Parameter.
    delattr(owner, weight_name)
    setattr(owner, weight_name, q)
    if bias_name and bias is not None:
        delattr(owner, bias_name)
        setattr(owner, bias_name, None)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all weights: float parameters plus the packed matrices of int8, oneDNN
    (runner/cpu/packed_linear.py) and GGUF layers (runner/quant/gguf_linear.py), which are
    not parameters."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.nbytes for m in model.modules()
                        if isinstance(m, (W8A8Int8Linear, Int8MatmulLinear, PackedLinear,
                                          GgufLinear)))


def check_method(model: Any, method: str) -> None:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                         f"got {method!r}")
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"--quantization {method} is built for CPU only")


def quantize_model(model: Any, method: str, calibration_ids: list[int] | None = None,
                   smoothing: str = "none", fixed: bool = False) -> dict:
    """Replace every linear layer of a loaded DecoderForCausalLM in place (an MoE decoder's
    blocks: quantize_experts); returns what ran (for /server_info). With `calibration_ids`,
    activation outliers are first smoothed into the weights (runner/quant/smoothing.py). The
    float matrices are released as each layer is replaced. `fixed`: deterministic
    inference (what stays float goes on the fixed GEMM)."""
    check_method(model, method)
    before = weight_bytes(model)
    layer_cls, kernel = int8_kernel()
    head_scale = smooth_model(model, calibration_ids) if calibration_ids else None
    pack_float = float_packing(model)
    moe_layers = 0
    for layer in model.layers:
        for weight_name, bias_name in _LAYER_LINEARS:
            if getattr(layer, weight_name) is not None:  # None: an MoE layer's dense MLP
                replace_with_int8(layer, weight_name, bias_name, layer_cls)
        if getattr(layer, "moe", None) is not None:
            quantize_experts(layer.moe, layer_cls, fixed, pack_float)
            moe_layers += 1
    info = quantize_head(model, layer_cls, head_scale)
    model.linear = quantized_linear  # the attention's weights are all int8; a block has its own
    return {"quantization": method, "kernel": kernel, **activation_bits(model),
            "smoothing": smoothing, **({"int8_moe_layers": moe_layers} if moe_layers else {}),
            "weight_bytes_float": before, "weight_bytes": weight_bytes(model), **info}


def quantize_head(model: Any, layer_cls: Callable[..., nn.Module],
                  head_scale: torch.Tensor | None = None) -> dict:
    """The output projection int8 (smoothed by `head_scale`): a tied embedding keeps its
    float matrix for the lookup, the projection gets an int8 copy."""
    tied = model.lm_head is model.embed
    if tied:
        # The lookup keeps the float matrix; the projection gets an int8 copy of it.
        head = model.embed if head_scale is None else model.embed * head_scale
        q = layer_cls(head)
        delattr(model, "lm_head")
        model.lm_head = q
    else:
        if head_scale is not None:
            model.lm_head.data.mul_(head_scale)
        replace_with_int8(model, "lm_head", None, layer_cls)
    return {"tied_output_projection_copy": tied}


def activation_bits(model: nn.Module) -> dict:
    # 7 where any layer is fbgemm's without VNNI (levels 63), e.g. a shape the AVX2 tile does
    # not take beside the ones it does
    return {"activation_bits": 7 if any(isinstance(m, W8A8Int8Linear) and m.levels < 127
                                        for m in model.modules()) else 8}


def check_batch_invariant(model: nn.Module, flag: str = "--quantization") -> str:
    """--enable-deterministic-inference with w8a8_int8: every int8 layer must be kvstrata's
    own GEMM at every row count, which is batch-invariant as it stands (each row quantised
    with its own scale, int32 sums exact whatever their order, each output scaled by its
    row's and column's scale alone; tests/correctness/test_batch_invariance.py). fbgemm's
    layer, oneDNN's above a row split and the AMX tiles are not pinned: refused by name.
    Returns the kernel's name."""
    for name, layer in model.named_modules():
        if isinstance(layer, W8A8Int8Linear):
            why = f"fbgemm's int8 layer ({layer.in_features} -> {layer.out_features})"
        elif isinstance(layer, Int8MatmulLinear) and not layer.own:
            why = "oneDNN's int8 linear (this CPU has VNNI but the shape does not fit the own GEMM)"
        elif isinstance(layer, Int8MatmulLinear) and (layer.packed is not None or layer.amx):
            why = "KVSTRATA_CPU_INT8_GEMM's row split / AMX tiles"
        else:
            continue
        raise NotImplementedError(f"not implemented yet: --enable-deterministic-inference "
                                  f"with {flag} w8a8_int8 where a layer runs {why} "
                                  f"({name})")
    return int8_linear.kernel_name()
