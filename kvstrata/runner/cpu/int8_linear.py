"""`--quantization w8a8_int8` on a CPU with VNNI, in the model's dtype: kvstrata's own int8
GEMM with the row ops fused in (AVX512-VNNI), or oneDNN's prepacked int8 linear between two
fused row ops (AVX-VNNI only, shapes outside the own GEMM's layout).

Why: the fbgemm layer (runner/quant/w8a8.py W8A8Int8Linear) takes float32 activations, so a
bf16 model paid two conversions a linear, and its per-token scaling is four torch ops around
the GEMM; served SmolLM2 at w8a8 was slower than bf16 (259 vs 372 tok/s, AVX-512 BF16 EPYC).
Measured on that box (2 threads, SmolLM2's shapes, every layer's own weights so that they
stream from RAM as in a real step): the 120 layer GEMMs of a decode step at M = 32 rows took
9.2 ms with oneDNN's int8 linear on weights prepacked once (`onednn::qlinear_prepack` /
`qlinear_pointwise`, u8 x s8 -> s32 on VNNI) against 11.8 ms with `torch._int_mm` (which
reorders the plain weight on every call) and ~13 ms with the prepacked bf16 linear; at
prefill shapes (M = 2048) both int8 GEMMs run ~1.9x the bf16 one.

Scheme: SGLang's w8a8_int8, as the fbgemm layer computes it: int8 weights with one symmetric
scale per output channel (amax / 127), activations quantised per token on the fly (amax /
127, codes in [-127, 127], given to the GEMM as u8 with zero point 128), int32 accumulation,
y = acc * w_scale (oneDNN) * x_scale (+ bias) (ours) in the activations' dtype. A token's
result never depends on the other rows of its batch. The row ops are C
(runner/cpu/csrc/int8_ops.c, AVX-512 chosen at run time).

Used when the CPU has AVX512-VNNI or AVX-VNNI (without them oneDNN's u8*s8 pairs can saturate
int16: the fbgemm layer keeps 7-bit activations there instead), torch has oneDNN, and
KVSTRATA_CPU_INT8_MM is on.

With AVX512-VNNI the GEMM is kvstrata's own (runner/cpu/csrc/int8_gemm.h; KVSTRATA_CPU_INT8_GEMM=
onednn keeps oneDNN's): one C call quantises the rows, multiplies on VNNI-packed weights and
writes the model's dtype, the same values bit for bit. Measured (2 threads, AVX-512 EPYC,
SmolLM2's four layer shapes x 30 weights streaming from RAM, benchmarks/bench_gemm.py):
at M = 1 / 8 / 32 rows 1.8-2.0x / 1.9x / 1.4-1.8x faster than the three oneDNN-path calls,
at 2048 rows 1.25x; so one weight layout and one kernel serve every row count.
"""
from __future__ import annotations

import torch
from torch import nn

from kvstrata import envs
from kvstrata.platform import VNNI_FLAGS, read_cpu_flags
from kvstrata.runner.cpu import _int8_ops, fused_ops as cpu_ops
from kvstrata.runner.cpu.fused_ops import _rows
from kvstrata.runner.cpu.isa import isa_cap

KERNEL = "oneDNN prepacked int8 linear (onednn::qlinear_pointwise, VNNI) + per-token rows"
OWN_KERNEL = "kvstrata int8 GEMM (AVX512-VNNI, runner/cpu/csrc/int8_gemm.h), rows fused in"
OWN_AVX2_KERNEL = ("kvstrata int8 GEMM (AVX2 vpmaddubsw, runner/cpu/csrc/int8_gemm_avx2.h), "
                   "rows fused in")
OWN_AMX_KERNEL = "kvstrata int8 GEMM (AMX-INT8, runner/cpu/csrc/int8_gemm_amx.h), rows fused in"
GEMM_CHOICES = ("auto", "onednn", "own", "own_decode", "amx")
# own_decode: kvstrata's GEMM up to this many rows, oneDNN's int8 linear above (its AMX tiles
# won from ~512 rows on an H200 host's Xeon: 0.75x ours there, ours 1.43x theirs at 128)
OWN_DECODE_MAX_ROWS = 128
PACK_ROWS_HINT = 32  # as packed_linear.py: measured indifferent between 32 and 2048 rows
LEVELS = 127
ZERO_POINT = 128  # the u8 code of 0 (int8_ops.c quant_rows)
_DTYPES = cpu_ops.DTYPES  # the C ops' dtype codes (fp32 0, bf16 1)
ROW_DTYPES = tuple(_DTYPES)  # what own_rows takes


def available(has_vnni: bool) -> bool:
    """This layer runs on this CPU (VNNI, torch's oneDNN int8 linear) unless ablated."""
    return (has_vnni and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.onednn, "qlinear_pointwise") and envs.KVSTRATA_CPU_INT8_MM.get())


def _has_vnni512() -> bool:
    """The int8 GEMM multiplies with AVX512-VNNI here (cap 2: the layout is chosen at load,
    whatever a later KVSTRATA_CPU_ISA pin)."""
    return _int8_ops.kernel_isa(2) == 2


def _gemm_choice() -> str:
    choice = envs.KVSTRATA_CPU_INT8_GEMM.get().strip().lower()
    if choice not in GEMM_CHOICES:
        raise ValueError(f"KVSTRATA_CPU_INT8_GEMM={choice!r} is not one of {GEMM_CHOICES}")
    return choice


def avx2_gemm_available() -> bool:
    """kvstrata's GEMM runs its AVX2 tile here: a CPU with AVX2 + FMA + F16C and no VNNI
    (oneDNN's u8 x s8 pairs saturate there, so without this tile the layer is fbgemm's with
    7-bit activations), KVSTRATA_CPU_INT8_MM on and KVSTRATA_CPU_INT8_GEMM=auto. Measured on
    an AVX2 EPYC (2 threads, SmolLM2's 120 layer weights streaming from RAM): 2.3x fbgemm's
    layer at 1 row, 1.6x at 8, 1.06x at 32, 0.8x at 256 (vpmaddubsw needs a vpsignb and a
    vpmaddwd beside it per 32 products). KVSTRATA_CPU_INT8_GEMM=own takes the tile with VNNI
    too (an A/B against oneDNN's)."""
    if not envs.KVSTRATA_CPU_INT8_MM.get():
        return False  # the layer is off: the GEMM choice is not read (as before `own`)
    choice = _gemm_choice()
    return (choice != "onednn" and (choice in ("own", "own_decode")
                                    or not VNNI_FLAGS & read_cpu_flags())
            and _int8_ops.kernel_isa(1) == 1)


def own_gemm_fits(in_features: int, out_features: int) -> bool:
    """kvstrata's own GEMM takes this weight: its layout's shape rules, KVSTRATA_CPU_INT8_GEMM
    not onednn, and AVX512-VNNI here (AMX-INT8 CPUs too), or AVX2 without any VNNI
    (avx2_gemm_available; KVSTRATA_CPU_INT8_GEMM=own: with AVX-VNNI too). On AMX-INT8 (16
    cores of an H200 host's Xeon, 2026-12-04, benchmarks/bench_gemm.py) it ran SmolLM2's
    layers 2.1-2.3x oneDNN's AMX int8 path at 1-32 rows, 1.8x at 64, 1.4x at 128, 0.75x at
    512; served w8a8 (32 concurrent) 1371 / 1237 / 1400 tok/s against oneDNN's 931 / 917 /
    1097: one layout serves every row count there too."""
    choice = _gemm_choice()
    if not (choice != "onednn" and in_features % 4 == 0 and out_features % 16 == 0
            and in_features >= 4):
        return False
    if _has_vnni512():
        return True
    return avx2_gemm_available()


def padded_width(in_features: int, out_features: int) -> int | None:
    """The output width own_gemm_fits takes once zero rows pad `out_features` to the tiles'
    16 columns (a tiny vocabulary of 300), None where padding does not help (or split
    layouts would keep a second, unpadded oneDNN weight)."""
    padded = out_features + (-out_features) % 16
    if padded == out_features or split_layouts() or not own_gemm_fits(in_features, padded):
        return None
    return padded


def split_layouts() -> bool:
    """KVSTRATA_CPU_INT8_GEMM=own_decode on a CPU with VNNI: an own layer also keeps oneDNN's
    prepacked weight for more than OWN_DECODE_MAX_ROWS rows (the same values bit for bit; the
    int8 weight twice). The A/B for prefill rows on AMX-INT8, not a default: served
    unmeasured there."""
    return _gemm_choice() == "own_decode" and bool(VNNI_FLAGS & read_cpu_flags())


def kernel_name() -> str:
    """What the layer runs on this CPU for SmolLM2-like shapes (for /server_info)."""
    if not own_gemm_fits(64, 64):
        return KERNEL
    own = OWN_KERNEL if _has_vnni512() else OWN_AVX2_KERNEL
    if _gemm_choice() == "amx" and _int8_ops.kernel_isa(3) == 3:
        own = f"{OWN_AMX_KERNEL} above 4 rows, {OWN_KERNEL} below"
    return f"{own} up to {OWN_DECODE_MAX_ROWS} rows, above them {KERNEL}" if split_layouts() \
        else own


def pack_vnni(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [n, k] -> int8_gemm.h's layout ([n / 16][k / 4][16][4]) and each column's
    zero-point term 128 * sum_k w (int32)."""
    n, k = qweight.shape
    packed = qweight.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    comp = (qweight.sum(1, dtype=torch.int32) * ZERO_POINT).to(torch.int32).contiguous()
    return packed, comp


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scales [N]): symmetric, one scale per output channel."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / LEVELS).clamp_(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def cpu_weight_shape(weight: torch.Tensor) -> tuple[int, int]:
    """(out, in) features of a weight an int8 layer may take: CPU only."""
    if weight.device.type != "cpu":
        raise ValueError("--quantization w8a8_int8 is built for CPU only "
                         f"(the model is on {weight.device.type})")
    return tuple(weight.shape)


class Int8MatmulLinear(nn.Module):
    """y = x @ W.T + b with W in int8 (per-channel scales) and x quantised per token."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = cpu_weight_shape(weight)
        qweight, self.w_scale = quantize_weight(weight)
        self.own = own_gemm_fits(self.in_features, self.out_features)
        # An output width the GEMM's 16-column tiles do not take (a tiny vocabulary of 300):
        # zero rows pad the packed weight and the result is cut back (one copy), rather than
        # fbgemm's layer (7-bit activations, not batch-invariant by construction).
        self.pad = 0
        padded = None if self.own else padded_width(self.in_features, self.out_features)
        if padded is not None:
            self.own, self.pad = True, padded - self.out_features
        # KVSTRATA_CPU_INT8_GEMM=amx: the GEMM may take AMX-INT8 tiles (cap 3 to its calls)
        self.amx = self.own and _gemm_choice() == "amx"
        # the most rows kvstrata's GEMM takes (all where it is the one layout; split_layouts:
        # OWN_DECODE_MAX_ROWS, oneDNN's above)
        self.own_max_rows = 0
        self.packed = None
        split = self.own and split_layouts()
        if self.own:
            self.vnni, self.comp = pack_vnni(torch.nn.functional.pad(qweight, (0, 0, 0, self.pad)))
            self.own_max_rows = OWN_DECODE_MAX_ROWS if split else 1 << 62
        if not self.own or split:
            self.packed = torch.ops.onednn.qlinear_prepack(qweight,
                                                           [PACK_ROWS_HINT, self.in_features])
            self.w_zero = torch.zeros(self.out_features, dtype=torch.int64)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        if self.pad:  # the C call reads a scale and a bias per packed column
            self.w_scale = torch.nn.functional.pad(self.w_scale, (0, self.pad), value=1.0)
            if self.bias is not None:
                self.bias = torch.nn.functional.pad(self.bias, (0, self.pad))
        self.nbytes = (qweight.numel() * (1 + (self.own and self.packed is not None))
                       + 4 * self.out_features * (1 + (bias is not None) + self.own))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype in _DTYPES and x.is_contiguous():
            return self._linear_rows(x, x.shape[0], self.in_features)  # the decoder's calls
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in _DTYPES:
            x2 = x2.float()
        rows = _rows(x2)
        if rows is None:
            x2 = x2.contiguous()
            rows = (x2.shape[0], self.in_features)
        out = self._linear_rows(x2, *rows).reshape(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _linear_rows(self, x: torch.Tensor, m: int, stride: int) -> torch.Tensor:
        """[m, in] rows `stride` elements apart (fp32 / bf16) -> [m, out] in x's dtype. Few
        Python steps on purpose: a decode step makes 121 of these calls."""
        if m <= self.own_max_rows:  # (m == 0 too: an empty result)
            return self.own_rows(x, m, stride, False)
        code = _DTYPES[x.dtype]
        y, scales, threads, cap = self._gemm(x, m, stride, code)
        out = y if code == 0 else torch.empty(m, self.out_features, dtype=x.dtype)  # in place
        _int8_ops.dequant_rows(y.data_ptr(), m, self.out_features, scales.data_ptr(),
                               self._bias_ptr(), out.data_ptr(), code, threads, cap)
        return out

    def linear_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this fused gate|up projection of x, the dequantisation done in
        the activation's pass (int8_ops.c dequant_silu_mul: the same values as this layer
        then cpu_ops.silu_mul, without writing and reading back the [m, 2 * inter]
        activation: SmolLM2's MLP input at 2048 rows bf16 7.5 -> 7.0 ms, at 32 rows 0.153 ->
        0.135 ms, best of 40 interleaved). None when x is not 2-D
        contiguous fp32 / bf16 rows or fused ops are off: the caller runs both steps."""
        if (x.dim() != 2 or x.dtype not in _DTYPES or not x.is_contiguous()
                or self.out_features % 2 or not cpu_ops.enabled()):
            return None
        if x.shape[0] <= self.own_max_rows:  # one call; widths its tiles do not pair: two
            if self.out_features % 32 or self.pad:
                return cpu_ops.silu_mul(self.own_rows(x, x.shape[0], self.in_features, False))
            return self.own_rows(x, x.shape[0], self.in_features, True)
        m, n, code = x.shape[0], self.out_features // 2, _DTYPES[x.dtype]
        out = torch.empty(m, n, dtype=x.dtype)
        if m:
            y, scales, threads, cap = self._gemm(x, m, self.in_features, code)
            _int8_ops.dequant_silu_mul(y.data_ptr(), m, n, scales.data_ptr(), self._bias_ptr(),
                                       out.data_ptr(), code, threads, cap)
        return out

    def own_rows(self, x: torch.Tensor, m: int, stride: int, silu: bool) -> torch.Tensor:
        """int8_ops.c linear: [m, in] rows -> [m, out] (silu: silu(gate) * up, [m, out / 2])
        in x's dtype, in one C call."""
        n = self.out_features + self.pad
        out = torch.empty(m, n // 2 if silu else n, dtype=x.dtype)
        if m:
            fn, args = self.own_call(x, m, stride, out, silu)
            fn(*args)
        return out[:, :self.out_features].contiguous() if self.pad else out

    def own_call(self, x: torch.Tensor, m: int, stride: int, out: torch.Tensor, silu: bool,
                 threads: int | None = None, cap: int | None = None) -> tuple:
        """(C function, arguments) of own_rows' call into `out`, not run: the decode plan
        (runner/models/decode_plan.py) keeps it. The bias is read now: a plan is made again
        for weights that change (never after loading). The ISA cap stops below AMX (3)
        unless KVSTRATA_CPU_INT8_GEMM=amx chose the tiles."""
        cap = isa_cap() if cap is None else cap
        cap = cap if self.amx else min(cap, 2)
        return _int8_ops.linear, (x.data_ptr(), stride, m, self.in_features, _DTYPES[x.dtype],
                                  self.vnni.data_ptr(), self.out_features + self.pad,
                                  self.comp.data_ptr(), self.w_scale.data_ptr(),
                                  self._bias_ptr(), out.data_ptr(), int(silu),
                                  torch.get_num_threads() if threads is None else threads,
                                  cap)

    def _bias_ptr(self) -> int:
        return 0 if self.bias is None else self.bias.data_ptr()  # read per call: never stale

    def _gemm(self, x: torch.Tensor, m: int, stride: int, code: int):
        """Quantise the rows, run the int8 GEMM: (acc * w_scale [m, out] fp32, the rows'
        scales, threads, ISA cap)."""
        threads, cap = torch.get_num_threads(), isa_cap()
        q = torch.empty(m, self.in_features, dtype=torch.uint8)
        scales = torch.empty(m, dtype=torch.float32)
        _int8_ops.quant_rows(x.data_ptr(), stride, m, self.in_features, code, q.data_ptr(),
                             scales.data_ptr(), threads, cap)
        # acc * w_scale in float32 (one rounding); the token scales and bias follow.
        y = torch.ops.onednn.qlinear_pointwise(q, 1.0, ZERO_POINT, self.packed, self.w_scale,
                                               self.w_zero, None, 1.0, 0, torch.float32,
                                               "none", [], "")
        return y, scales, threads, cap

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
