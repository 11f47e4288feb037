"""Float32 and bf16 linear layers on the CPU with oneDNN-prepacked weights (the float path's
GEMMs).

Why: a decode step is a batch of M = 32-ish rows through every linear layer, and torch's
`F.linear` (MKL on an un-packed [N, K] weight) runs those shapes far below the FMA peak.
oneDNN's linear over a weight reordered once into its blocked layout measured, at SmolLM2
shapes on the 2-core box (2 threads): 576->3072 at M=32 0.88 -> 0.58 ms, 1536->576 0.40 ->
0.30 ms, the 49152-wide output head 24.4 -> 10.4 ms, and a 2048-row prefill GEMM 40 -> 33 ms
(the bench of record is benchmarks/bench_decode_step.py). Results differ from F.linear by
float rounding only (accumulation order).

The ops (`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`) are the ones
torch.compile's CPU backend emits for the same purpose. Applied once after load to the
llama-family decoder in float32 or bf16 on the CPU, when torch has oneDNN;
KVSTRATA_CPU_PACKED_LINEAR=0 keeps F.linear (ablation). `--quantization w8a8_int8` replaces
these layers instead.

bf16 on a CPU with AVX512-BF16 runs kvstrata's own GEMM instead (with AMX-BF16 on its AMX
tiles, runner/cpu/csrc/bf16_gemm_amx.h, for decode rows only, oneDNN's AMX tiles above 64 rows:
split_layouts; runner/cpu/csrc/bf16_gemm.c; KVSTRATA_CPU_BF16_GEMM=onednn keeps oneDNN's): the
int8 GEMM's tiles on vdpbf16ps, weights packed once in pairs of k, the next panel's weights
prefetched while the rows multiply the current one, and the gate|up projection's silu(gate) *
up written from its registers. Measured on an AVX-512 BF16 EPYC (2 threads, SmolLM2's four
layer shapes x 30 weights streaming from RAM, benchmarks/bench_gemm.py --kind bf16): at 32
rows 1.16-1.45x oneDNN's speed, at 8 rows 1.28x, at 1 row 1.02-1.3x, at 2048 rows 0.96-1.05x.
Same fp32 accumulation as oneDNN's bf16 kernels; results differ from them by accumulation
order only.

bf16 on a CPU where oneDNN has no bf16 kernels (AVX2 without AVX-512, where torch's bf16
F.linear ran 17-18 GFLOP/s against fp32's 90-135) runs the same GEMM's AVX2 + FMA body
(runner/cpu/csrc/bf16_gemm_avx2.h: each packed pair of bf16 weights widened to fp32 by a shift and
a mask, fp32 FMAs). Measured on a 2-vCPU AVX2 EPYC (benchmarks/bench_gemm.py --kind bf16):
3.9-6.0x torch's bf16 F.linear at 8-512 rows; against fp32's prepacked oneDNN linear (half the
weight bytes, the same FMAs) 1.4x at 1-8 rows, 0.97x at 32, 0.89x at 128, 0.77x at 512;
since its panels are widened once per thread from 25 rows on (bf16_gemm_avx2.h), about fp32's
speed from 32 rows on (0.9-1.2x at 32-2048 rows, a noisy 2-vCPU box). A
layer neither GEMM takes there keeps F.linear.

fp32 layers at 1-8 rows (a decode step at batch 1-8: bound by the weights' bandwidth, where
oneDNN's layout streamed 13-21 GB/s against a 26-36 GB/s read on the AVX2 EPYC) run
kvstrata's GEMV over a second, panel-packed copy of the weight where f32_gemv.worth_copies
allows it (runner/cpu/f32_gemv.py): SmolLM2's fp32 decode step 1.14-1.32x faster at batch 1-4,
1.07x at 8; on an AVX2-only CPU up to 16 rows (the layers' GEMMs 1.13-1.29x at 10-16).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kvstrata import envs
from kvstrata.runner.cpu import _bf16_ops, fused_ops as cpu_ops, f32_gemv
from kvstrata.runner.cpu.fixed_linear import (DTYPES, FIXED_EVERY_ROW_COUNT, FIXED_F32_KERNEL,
                                              fixed_f32, fixed_unsupported)
from kvstrata.runner.cpu.isa import ISA_CAPS, isa_cap

KERNEL = "oneDNN prepacked fp32/bf16 (torch.ops.mkldnn._linear_pointwise)"
OWN_BF16_KERNEL = "kvstrata bf16 GEMM (AVX512-BF16, runner/cpu/csrc/bf16_gemm.c)"
OWN_BF16_AVX2_KERNEL = "kvstrata bf16 GEMM (AVX2 + FMA, runner/cpu/csrc/bf16_gemm_avx2.h)"
OWN_BF16_AMX_KERNEL = "kvstrata bf16 GEMM (AMX-BF16, runner/cpu/csrc/bf16_gemm_amx.h)"
PLAIN_KERNEL = "torch F.linear (no bf16 GEMM of oneDNN's or kvstrata's on this CPU)"
GEMM_CHOICES = ("auto", "onednn", "own", "own_decode")
# own_decode: kvstrata's GEMM up to this many rows (decode batches), oneDNN's above (prefill)
OWN_DECODE_MAX_ROWS = 64
# The decoder's linear weights: (weight attribute, bias attribute), as in quantization.py.
LAYER_LINEARS = (("qkv_weight", "qkv_bias"), ("o_weight", "o_bias"),
                 ("gate_up_weight", "gate_up_bias"), ("down_weight", "down_bias"))
# Batch-size hint for the weight layout; measured indifferent between 32 and 2048 rows.
PACK_ROWS_HINT = 32


def available(model: Any) -> bool:
    """The model's linears can be packed here: judged by its first layer's first linear
    weight (`packed_linears`, else the decoder's LAYER_LINEARS)."""
    linears = getattr(model, "packed_linears", LAYER_LINEARS)
    layer = model.layers[0] if len(model.layers) else None
    weight = next((getattr(layer, w) for w, _ in linears
                   if getattr(layer, w, None) is not None), None)
    if not (torch.backends.mkldnn.is_available() and isinstance(weight, torch.Tensor)
            and weight.dtype in DTYPES and weight.device.type == "cpu"):
        return False
    # oneDNN's bf16 kernels need AVX-512 (BW/VL) at least; on AVX2 kvstrata's own GEMM takes
    # bf16 (a layer it does not fit keeps F.linear).
    return (weight.dtype == torch.float32 or _onednn_bf16()
            or _bf16_ops.kernel_isa(isa_cap()) > 0)


def _onednn_bf16() -> bool:
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def own_bf16_fits(weight: torch.Tensor) -> bool:
    """kvstrata's bf16 GEMM takes this weight: bf16 on a CPU with AVX512-BF16 (and
    KVSTRATA_CPU_ISA allowing AVX-512; with AMX-BF16 too, for decode rows: see split_layouts),
    or with AVX2 + FMA where oneDNN has no bf16 kernels; its layout's shape rules (in % 2, out
    % 16) and KVSTRATA_CPU_BF16_GEMM not onednn. KVSTRATA_CPU_BF16_GEMM=own takes it wherever
    one of its bodies runs (AVX2 CPUs whose oneDNN has bf16 kernels too)."""
    choice = _gemm_choice()
    out_features, in_features = weight.shape
    if not (choice != "onednn" and weight.dtype == torch.bfloat16 and in_features % 2 == 0
            and out_features % 16 == 0):
        return False
    if _bf16_ops.has_bf16_512(isa_cap()):
        return True
    return _bf16_ops.kernel_isa(isa_cap()) == 1 and (choice != "auto" or not _onednn_bf16())


def split_layouts() -> bool:
    """An own bf16 layer also keeps oneDNN's layout for more than OWN_DECODE_MAX_ROWS rows:
    KVSTRATA_CPU_BF16_GEMM=own_decode, or auto on an AMX-BF16 CPU. There oneDNN multiplies
    prefill rows on AMX tiles (at 512 rows 6x the own GEMM's speed on 16 cores of an H200
    host's Xeon, 2026-12-04) while its decode rows scaled badly with the cores: at batch 32
    oneDNN's bf16 step took 54.8 ms against 23.0 on the own GEMM and fp32's 31.0 (16
    threads). Served (SmolLM2's shapes, 32 concurrent), 16 threads: bf16 on both layouts 661 /
    627 / 790 tok/s, fp32 499 / 554 / 595, bf16 on oneDNN alone 393, on the own GEMM alone 547
    / 468 / 546; 8 threads: both 469 / 634, oneDNN alone 412 / 464, fp32 514 / 440. With
    the own GEMM on AMX tiles (session 28) it ran 1.03x oneDNN's at 512 rows and 1.2-2.2x at
    1-128, yet served the split still led: 880 vs 812 tok/s (one round), 1025 / 623 vs 787 /
    742 (two), so auto keeps it. The two bf16 layouts take the memory of one fp32 copy
    (layer nbytes count both).

    auto asks whether the AMX tiles run in this process (amx_bf16_ready), not whether the CPU
    names them: a VM can list amx_bf16 while Linux does not grant the tile data (a Firecracker
    guest, 2026-12-07), and there neither kvstrata's AMX body nor oneDNN's tiles run, so a
    second layout doubled the bf16 weights for prefill rows oneDNN multiplies on AVX-512 too."""
    choice = _gemm_choice()
    return choice == "own_decode" or (choice == "auto" and amx_bf16_ready())


def amx_bf16_ready() -> bool:
    """kvstrata's bf16 GEMM would run its AMX-BF16 body in this process (bf16_gemm.c: the CPU
    has AMX-BF16 and Linux granted the tile data, amx_tiles.h amx_ready), whatever
    KVSTRATA_CPU_ISA caps: the permission that oneDNN's AMX tiles need too."""
    return _bf16_ops.kernel_isa(ISA_CAPS["amx"]) == 3


def _gemm_choice() -> str:
    choice = envs.KVSTRATA_CPU_BF16_GEMM.get().strip().lower()
    if choice not in GEMM_CHOICES:
        raise ValueError(f"KVSTRATA_CPU_BF16_GEMM={choice!r} is not one of {GEMM_CHOICES}")
    return choice


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [n, k] -> bf16_gemm.c's layout ([n / 16][k / 2][16][2])."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_bf16(packed: torch.Tensor) -> torch.Tensor:
    """pack_bf16's inverse: the plain [n, k] weight (a copy)."""
    nb, half_k = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(nb * 16, half_k * 2)


class PackedLinear(nn.Module):
    """A weight (and bias) in oneDNN's layout, in kvstrata's bf16 GEMM's (`own`), or as it is
    (`plain`: bf16 where neither GEMM takes it; F.linear); call through `packed_linear`.
    Where split_layouts() (AMX-BF16; KVSTRATA_CPU_BF16_GEMM=own_decode) an `own` layer also
    keeps oneDNN's layout (`onednn`, twice the bf16 weight memory) for more than
    OWN_DECODE_MAX_ROWS rows: oneDNN's AMX tiles for prefill, kvstrata's GEMM for decode;
    split=False keeps kvstrata's layout alone for every row count (an MoE expert's weights,
    runner/cpu/fixed_experts.pack_block)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 gemv: bool = False, fixed: bool = False, split: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_packed = self.out_features  # the kernel's output width (fixed: padded)
        self.fixed = fixed
        if fixed:
            self._init_fixed(weight, bias)
            return
        self.own = own_bf16_fits(weight)
        self.plain = not self.own and weight.dtype == torch.bfloat16 and not _onednn_bf16()
        self.onednn = None  # oneDNN's layout beside the own one (split_layouts)
        # the most rows kvstrata's GEMM takes: every count where its layout is the only one,
        # OWN_DECODE_MAX_ROWS beside oneDNN's, none in a layer it does not take
        self.own_max_rows = 0
        if self.own:
            self.packed = pack_bf16(weight)
            self.bias_f32 = None if bias is None else bias.detach().float().contiguous()
            self.own_max_rows = 1 << 62
            if split and split_layouts() and _onednn_bf16():
                self.onednn = _onednn_pack(weight)
                self.own_max_rows = OWN_DECODE_MAX_ROWS
        elif self.plain:
            self.packed = weight.detach().contiguous()
        else:
            self.packed = _onednn_pack(weight)
        self.bias = None if bias is None else bias.detach().clone()
        size = weight.element_size()
        self.nbytes = weight.numel() * size + (0 if bias is None else bias.numel() * size)
        if self.own and bias is not None:
            self.nbytes += 4 * bias.numel()  # the fp32 copy the GEMM's epilogue adds
        if self.onednn is not None:
            self.nbytes += weight.numel() * size
        # fp32 only: a second copy of the weight in f32_gemv.h's panels for 1-16 rows (see
        # f32_gemv.py; pack_model decides whether the copies are worth their memory).
        self.gemv = (f32_gemv.pack(weight) if gemv and f32_gemv.fits(weight)
                     and not (self.own or self.plain) else None)
        if self.gemv is not None:
            self.nbytes += self.gemv.numel() * 4
        # more rows than the GEMV's through kvstrata's fp32 GEMM over the same copy (there)
        self.gemm_f32 = self.gemv is not None and f32_gemv.gemm_above()

    def _init_fixed(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Deterministic inference: one kvstrata GEMM for every row count, so that a row's
        result never depends on how many rows share the call -- bf16 on the bf16 GEMM
        (whose tiles sum each output over k in one order for any rows), fp32 on the fp32
        GEMM over f32_gemv's panels (the GEMV at 1-16 rows and oneDNN above 64 sum in
        other orders). A width its tiles do not take (an output head of 300 tokens) is
        padded with zero rows to a multiple of 16 and the output cut back."""
        reason = fixed_unsupported(weight)
        if reason is not None:
            raise ValueError(f"--enable-deterministic-inference: {reason}")
        pad = -self.out_features % 16
        padded = torch.cat([weight.detach(), weight.new_zeros(pad, self.in_features)])
        self.out_packed = self.out_features + pad
        f32_bias = None
        if bias is not None:
            f32_bias = torch.cat([bias.detach().float(), bias.new_zeros(pad, dtype=torch.float32)])
        self.onednn, self.plain = None, False
        self.bias = None if bias is None else bias.detach().clone()
        size = weight.element_size()
        self.nbytes = padded.numel() * size + (0 if bias is None else bias.numel() * size)
        self.own = weight.dtype == torch.bfloat16
        if self.own:
            self.packed, self.bias_f32 = pack_bf16(padded), f32_bias
            self.own_max_rows, self.gemv, self.gemm_f32 = 1 << 62, None, False
            if bias is not None:
                self.nbytes += 4 * f32_bias.numel()
        else:  # fp32: the panels only (no oneDNN layout: nothing else runs its rows)
            self.packed, self.bias_f32, self.own_max_rows = None, None, 0
            self.gemv, self.gemm_f32 = f32_gemv.pack(padded), True
            self.gemv_bias = f32_bias
            self.nbytes = self.gemv.numel() * 4 + (0 if bias is None else 4 * f32_bias.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self)

    def own_takes(self, x: torch.Tensor) -> bool:
        """kvstrata's GEMM runs x's rows (up to own_max_rows of them)."""
        return self.own and x.numel() <= self.own_max_rows * self.in_features

    def own_rows(self, x: torch.Tensor, silu: bool = False, f32: bool = False) -> torch.Tensor:
        """bf16_gemm.c linear over x's rows ([..., in] -> [..., out], or silu(gate) * up:
        [..., out / 2]) in one C call; x in another dtype is converted, the result is bf16
        (f32: the same bf16 values widened to fp32)."""
        n = self.out_packed
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.bfloat16 or x2.stride(-1) != 1 or x2.stride(0) < self.in_features:
            x2 = x2.to(torch.bfloat16).contiguous()
        m = x2.shape[0]
        out = torch.empty(m, n // 2 if silu else n, dtype=torch.float32 if f32 else torch.bfloat16)
        call = self.own_call(x2, out, silu, f32)
        if m and call is None:  # ISA pinned to scalar after packing
            y = F.linear(x2, unpack_bf16(self.packed), self.bias)
            out.copy_(cpu_ops.silu_mul(y) if silu else y)
        elif m:
            call[0](*call[1])
        if n != self.out_features:  # a padded width (fixed)
            out = out[:, :self.out_features].contiguous()
        return out.view(*x.shape[:-1], out.shape[-1])

    def own_call(self, x2: torch.Tensor, out: torch.Tensor, silu: bool = False,
                 f32: bool = False, threads: int | None = None,
                 cap: int | None = None) -> tuple | None:
        """(C function, arguments) of kvstrata's bf16 GEMM over bf16 rows x2 [m, in] (each
        row contiguous) into out, not run: own_rows makes this call, the decode plan
        (runner/models/decode_plan.py) keeps it. None where the GEMM does not run (not an
        `own` layer, or the ISA pinned to scalar)."""
        cap = isa_cap() if cap is None else cap
        if self.fixed:  # one body at every row count (the AMX tiles where they run)
            cap |= FIXED_EVERY_ROW_COUNT
        if not self.own or not _bf16_ops.kernel_isa(cap):
            return None
        bias = 0 if self.bias_f32 is None else self.bias_f32.data_ptr()
        return _bf16_ops.linear, (x2.data_ptr(), x2.stride(0), x2.shape[0], self.in_features,
                                  self.packed.data_ptr(), self.out_packed, bias,
                                  out.data_ptr(), int(silu), int(f32),
                                  torch.get_num_threads() if threads is None else threads,
                                  cap)

    def linear_float(self, x: torch.Tensor) -> torch.Tensor | None:
        """F.linear(x, W, b).float() in one pass (an output head's logits: the bf16 values,
        widened as the GEMM stores them), or None for oneDNN's layout."""
        return self.own_rows(x, f32=True) if self.own_takes(x) else None

    def linear_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this fused gate|up projection of x from the GEMM's registers
        (the same values as this layer then cpu_ops.silu_mul), or None where that is not
        this layer's to do (oneDNN's layout, fused ops off, a width its tiles do not pair):
        the caller runs both steps."""
        if (not self.own_takes(x) or x.dim() != 2 or x.dtype != torch.bfloat16
                or self.out_features % 32 or not cpu_ops.enabled()):
            return None
        return self.own_rows(x, silu=True)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def packed_linear(x: torch.Tensor, layer: PackedLinear,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for F.linear(x, weight, bias) once `weight` became a PackedLinear (which holds
    its bias, so `bias` is None)."""
    if layer.own_takes(x):
        return layer.own_rows(x)
    if layer.onednn is not None:
        return _onednn_linear(x, layer.onednn, layer.bias)
    if layer.fixed and layer.gemv is not None:
        return fixed_f32(x, layer)
    if layer.gemv is not None:
        out = f32_gemv.linear(x, layer.gemv, layer.bias, gemm=layer.gemm_f32)
        if out is not None:
            return out
    if layer.plain:
        return F.linear(x, layer.packed, layer.bias)
    return _onednn_linear(x, layer.packed, layer.bias)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def replace_weight(owner: nn.Module, weight_name: str, bias_name: str | None,
                   gemv: bool = False, fixed: bool = False) -> None:
    """owner.<weight_name> (and its bias, whose attribute becomes None) -> a PackedLinear."""
    weight = getattr(owner, weight_name)
    bias = getattr(owner, bias_name) if bias_name else None
    packed = PackedLinear(weight, bias, gemv, fixed)
    delattr(owner, weight_name)  # a Module cannot be assigned over a Parameter
    setattr(owner, weight_name, packed)
    if bias_name and bias is not None:
        delattr(owner, bias_name)
        setattr(owner, bias_name, None)


def _pack_layers(model: Any, fixed: bool = False) -> bool:
    """Returns whether the layers' fp32 weights also got f32_gemv's copies. A model whose
    layers hold other linears names its 2-D ones in `packed_linears` (gpt-oss: attention
    only; its router and 3-D expert stacks: runner/cpu/fixed_experts.pack_moe_layers)."""
    linears = getattr(model, "packed_linears", LAYER_LINEARS)
    # A weight that is None is not in that layer (an MoE layer of moe_decoder.py has experts
    # in place of the dense MLP).
    present = [(layer, w, b) for layer in model.layers for w, b in linears
               if getattr(layer, w) is not None]
    gemv = not fixed and f32_gemv.worth_copies([getattr(layer, w) for layer, w, _ in present])
    for layer, weight_name, bias_name in present:
        replace_weight(layer, weight_name, bias_name, gemv, fixed)
    return gemv


def pack_model(model: Any, fixed: bool = False) -> dict:
    """Pack every linear layer of a loaded float32 / bf16 DecoderForCausalLM in place; returns what
    ran (for /server_info). A tied output head gets a packed copy (the lookup keeps the
    plain embedding matrix). fixed (deterministic inference): every layer on one kvstrata
    GEMM for all row counts (PackedLinear._init_fixed)."""
    gemv = _pack_layers(model, fixed)
    tied = model.lm_head is model.embed
    if tied:
        head = PackedLinear(model.embed, fixed=fixed)
        delattr(model, "lm_head")
        model.lm_head = head
    else:
        replace_weight(model, "lm_head", None, fixed=fixed)
    model.linear = packed_linear
    return {"quantization": None, "kernel": kernel_name(model.lm_head),
            "tied_output_projection_copy": tied,
            "small_batch_kernel": f32_gemv.KERNEL if gemv else None,
            "decode_batch_kernel": (f32_gemv.GEMM_KERNEL if gemv and f32_gemv.gemm_above()
                                    else None)}


def kernel_name(layer: PackedLinear) -> str:
    if layer.fixed and not layer.own:
        return FIXED_F32_KERNEL
    if layer.fixed:
        return _own_name() + " at every row count (deterministic inference)"
    if layer.own:
        own = _own_name()
        if layer.onednn is not None:
            return f"{own} up to {OWN_DECODE_MAX_ROWS} rows, above them {KERNEL}"
        return own
    return PLAIN_KERNEL if layer.plain else KERNEL


def _own_name(max_cap: int = 3) -> str:
    return {3: OWN_BF16_AMX_KERNEL, 2: OWN_BF16_KERNEL}.get(
        _bf16_ops.kernel_isa(min(isa_cap(), max_cap)), OWN_BF16_AVX2_KERNEL)


def pack_draft_head(head: Any, fixed: bool = False) -> dict:
    """Pack an EAGLE / EAGLE3 head's decoder layer(s) and fc in place (the head borrows the
    target's embedding and output head, which the target packed already). Its forwards are
    one-row-per-request GEMMs like a decode step's, where F.linear is slowest."""
    gemv = _pack_layers(head, fixed)
    replace_weight(head, "fc_weight", "fc_bias", gemv, fixed)
    if isinstance(getattr(head, "lm_head", None), torch.Tensor):  # EAGLE3's own (hot) head
        replace_weight(head, "lm_head", None, fixed=fixed)
    head.linear = packed_linear
    return {"quantization": None, "kernel": kernel_name(head.fc_weight)}

