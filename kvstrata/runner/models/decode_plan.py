"""A decode step's decoder layers as C calls bound once per batch size (CPU).

Why: once the linears, norms, rotary, KV write and decode attention each became one C call,
a SmolLM2 decode step at batch 1 still spent ~5 ms of ~22 (fp32, 2-vCPU AVX2 EPYC) between
those calls: each Python wrapper re-checked its tensors' dtypes, shapes and strides, asked
torch for a new output tensor (~240 torch.empty a step) and read module attributes, 30
layers x ~10 calls. Here a plan per decode batch size (kept per model) holds buffers for
the intermediates and each layer as a fixed list of (C function, arguments) tuples whose
pointers were computed once; a forward copies its inputs into the plan's buffers (six small
copies) and replays the calls: the same kernels with the same arguments in the same order,
so the logits are bit-identical to `layer_forward`'s (tests compare them). Making a plan
costs ~1.3 ms (SmolLM2), so it is not made again for every step.

It applies to a CPU llama-family model without per-head q/k norms, with the fused ops on,
one tensor-parallel rank, no EAGLE3 capture, and a forward that is one decode piece of the
paged decode kernel (plain decode rows, or a verify step's one-token queries) over a pool of
the model's dtype. Linears that are kvstrata's fp32 GEMV (1-16 rows), bf16 GEMM, int8 GEMM or
GGUF blocks kept packed (fp32 activations, no bias: runner/quant/gguf_linear.py's
bound_calls) are C calls with bound pointers; any other (oneDNN's fp32 layout above the GEMV's rows,
oneDNN's or fbgemm's int8 layer, F.linear) is the model's own linear call with its result
copied into the plan's buffer: the same op on the same values (SmolLM2 steps, plan on / off
in one process, AVX2: fp32 at 24 rows 1.14x; w8a8 fp32 on fbgemm at 1 / 8 / 32 rows 1.34 /
1.16 / 1.11x, on kvstrata's AVX2 int8 tile at 1 / 8 rows 1.54 / 1.23x). Anything else
(prefill, draft trees, TP, q/k norms) returns None from `build` and takes `layer_forward`.
KVSTRATA_CPU_DECODE_PLAN=0 turns it off (ablation).

The residual add that ends layer l runs as the first half of layer l + 1's add + RMSNorm
(one pass, as the post-attention norm already did); the last layer's add is a torch add_.
Both round exactly as x.add_(down) followed by the norm.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch

from kvstrata import envs
from kvstrata.kv import _rowcopy
from kvstrata.runner.attention import paged_decode
from kvstrata.runner.attention.torch_native import TorchNativeAttnBackend
from kvstrata.runner.cpu import _bf16_ops, _cpu_ops, _int8_ops, fused_ops as cpu_ops, f32_gemv
from kvstrata.runner.cpu.int8_linear import ROW_DTYPES, Int8MatmulLinear
from kvstrata.runner.cpu.isa import isa_cap
from kvstrata.runner.cpu.packed_linear import PackedLinear, packed_linear
from kvstrata.runner.quant.gguf_linear import GgufLinear, gguf_linear
from kvstrata.runner.quant.gguf_pinned import pinned_linear
from kvstrata.runner.quant.w8a8 import quantized_linear

Call = tuple[Callable, tuple]


def enabled() -> bool:
    return envs.KVSTRATA_CPU_DECODE_PLAN.get()


class DecodePlan:
    """Every layer's calls for decode forwards of `t` rows, over buffers of its own: `bind`
    copies a forward's inputs in (the embedded tokens, cos / sin, the KV slots it writes and
    reads), `run()` updates the residual stream as the layer loop does and returns it (the
    plan's buffer: read it before the next forward)."""

    def __init__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 out_slots: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                 scratch: list[torch.Tensor]):
        self.x, self.cos, self.sin = x, cos, sin
        self.out_slots, self.slots, self.starts = out_slots, slots, starts
        self.scratch = scratch  # the calls hold their addresses: keep them alive
        self.layers: list[list[Call]] = []
        self.decode_args: list[list] = []  # each layer's kernel arguments (slot count set)
        self.side_args: list[list] = []  # the next layer's KV rows a GEMM prefetches (same)
        self.swa_slots = False  # an all-SWA model's pool: new K/V at fb.swa_out_slots

    def bind(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: Any) -> bool:
        """This forward's inputs into the buffers; False when its key slots outnumber the
        plan's room (build makes a larger plan)."""
        p = fb.attn_meta.pieces[0]
        n = p.slots.numel()
        out_slots = fb.swa_out_slots if self.swa_slots else fb.out_slots
        if (n > self.slots.numel() or p.starts.numel() != self.starts.numel()
                or out_slots.numel() != self.out_slots.numel()):
            return False
        self.x.copy_(x)
        self.cos.copy_(cos.view(-1))
        self.sin.copy_(sin.view(-1))
        self.out_slots.copy_(out_slots)
        self.slots[:n].copy_(p.slots)
        self.starts.copy_(p.starts)
        for args in self.decode_args:
            args[9] = n
        for args in self.side_args:
            args[4] = n
        return True

    def run(self) -> torch.Tensor:
        for calls in self.layers:
            for fn, args in calls:
                fn(*args)
        down = self.scratch[-1]
        return self.x.add_(down)


def _linear_call(model: Any, lin: Any, bias: Any, inp: torch.Tensor, out: torch.Tensor,
                 threads: int, cap: int, silu: bool = False) -> Call:
    """The C call the model's linear makes for inp [T, in] -> out (both contiguous):
    kvstrata's bf16 GEMM, fp32 GEMV or int8 GEMM with pointers bound once; else (oneDNN's
    fp32 layout above the GEMV's rows, oneDNN's or fbgemm's int8 layer, F.linear, a scalar
    ISA) the model's own linear call (`silu`: the layer's linear_silu_mul) with its result
    copied into out: the same op on the same values, so the same bits, for one extra copy."""
    call = None
    if (isinstance(lin, PackedLinear) and model.linear is packed_linear
            and lin.out_packed == lin.out_features):  # (a padded width: its copy below)
        if lin.own_takes(inp):  # (split layouts: oneDNN's above own_max_rows)
            call = lin.own_call(inp, out, silu, threads=threads, cap=cap)
        elif not silu and lin.gemv is not None:
            # the GEMV's own vector check (cap None): `cap` is the forward's pinned isa_cap()
            call = f32_gemv.gemv_call(inp, lin.gemv, lin.gemv_bias if lin.fixed else lin.bias,
                                      out, threads, gemm=lin.gemm_f32, fixed=lin.fixed)
    elif (type(lin) is Int8MatmulLinear and inp.shape[0] <= lin.own_max_rows
          and not lin.pad and model.linear is quantized_linear
          and inp.dtype in ROW_DTYPES and (not silu or lin.out_features % 32 == 0)):
        # quantized_linear's (and linear_silu_mul's) one C call over the plan's rows
        call = lin.own_call(inp, inp.shape[0], lin.in_features, out, silu, threads, cap)
    elif (type(lin) is GgufLinear and model.linear in (gguf_linear, pinned_linear) and not silu
          and (calls := lin.bound_calls(inp, out, threads, cap)) is not None):
        # a GGUF layer kept packed: its segments' kernel calls (~35 us of Python each through
        # forward, measured on SmolLM2 at batch 1); two or more run from one tuple. Under
        # deterministic inference (pinned_linear) too: both run a GgufLinear's forward, and
        # bound_calls declines a layer with a float segment (pinned on the fixed GEMM there)
        call = calls[0] if len(calls) == 1 else (_run_calls, (tuple(calls),))
    if call is not None:
        return call
    if silu:
        def copy_out() -> None:
            out.copy_(lin.linear_silu_mul(inp))
    else:
        def copy_out() -> None:
            out.copy_(model.linear(inp, lin, bias))
    return copy_out, ()


def _run_calls(calls: tuple) -> None:
    for fn, args in calls:
        fn(*args)


def _fused_silu(lin: Any, rows: int) -> bool:
    """layer_forward takes silu(gate) * up from the gate|up layer itself (linear_silu_mul)
    for these layers on the plan's inputs (2-D contiguous fp32 / bf16 rows, fused ops on):
    kvstrata's bf16 GEMM at widths its tiles pair, and runner/cpu/int8_linear.py's int8 layer."""
    if isinstance(lin, PackedLinear):
        return lin.own and lin.out_features % 32 == 0 and rows <= lin.own_max_rows
    return type(lin) is Int8MatmulLinear and lin.out_features % 2 == 0


def _pool(backend: Any) -> Any:
    """The one pool a uniform plan's layers all use: the main pool, or an all-SWA model's
    SWA pool (hybrid SWA memory with full layers is never uniform: window.plan_windows)."""
    return backend.kv_pool if backend.kv_pool is not None else backend.swa_pool


def _fits(model: Any, fb: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    meta = getattr(fb, "attn_meta", None)
    backend = model.attn_backend
    # meta.uniform: every layer runs this plan (sliding windows: all layers one window)
    if not (isinstance(backend, TorchNativeAttnBackend) and meta is not None and meta.single
            and meta.uniform and meta.prefill is None and fb.out_slots is not None):
        return False
    p = meta.pieces[0]
    kv = _pool(backend).kv
    t = x.shape[0]
    d = model.dims
    return (p.kind == "kernel" and p.tok_idx is None and p.lo == 0 and p.hi == t
            and not model.capture_layers
            and x.device.type == "cpu" and x.dtype in cpu_ops.DTYPES
            and x.dtype in paged_decode.Q_DTYPES
            and x.is_contiguous() and x.dim() == 2 and kv.dtype == x.dtype
            and cos.dtype == sin.dtype == x.dtype and cos.is_contiguous()
            and sin.is_contiguous() and cos.numel() == sin.numel() == t * d.head_dim
            and d.head_dim % 2 == 0 and cpu_ops.enabled())


MAX_PLANS = 16  # per model: decode batch sizes come and go; each plan holds a few MB at most


def slot_room(n: int) -> int:
    """Key slots a new plan has room for when a forward reads n: contexts grow every step."""
    return max(4096, 2 * n)


def build(model: Any, fb: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
          ) -> DecodePlan | None:
    """This forward's plan, bound to its inputs, or None where `layer_forward` must run the
    layers. Plans are kept per model by rows, dtype, threads, ISA cap, KV pool and scale (the
    weights never move after loading). The caller checks that `model` runs
    DecoderForCausalLM's own layer_forward and reduce (a tensor-parallel rank's overrides
    them)."""
    if not enabled() or not _fits(model, fb, x, cos, sin):
        return None
    backend = model.attn_backend
    kv = _pool(backend).kv  # a pool made again may reuse the address: its shape too
    # fixed: deterministic inference's order (paged_decode `fixed`), the piece's
    key = (x.shape[0], x.dtype, torch.get_num_threads(), isa_cap(), kv.data_ptr(),
           tuple(kv.shape), backend.scale, fb.attn_meta.pieces[0].fixed,
           envs.KVSTRATA_CPU_DECODE_KV_PREFETCH.get())
    plans = model.__dict__.setdefault("_decode_plans", OrderedDict())
    if key in plans:  # None: this model's layers do not fit (found once)
        plans.move_to_end(key)
        plan = plans[key]
        if plan is None or plan.bind(x, cos, sin, fb):
            return plan
    plan = _make(model, key, slot_room(fb.attn_meta.pieces[0].slots.numel()))
    plans[key] = plan
    if len(plans) > MAX_PLANS:
        plans.popitem(last=False)
    return plan if plan is not None and plan.bind(x, cos, sin, fb) else None


def _make(model: Any, key: tuple, capacity: int) -> DecodePlan | None:
    """A plan of `key`'s rows with room for `capacity` key slots, or None where a layer is not
    the plan's: per-head q/k norms, or a linear that is not one of its kernels."""
    if any(layer.q_norm is not None for layer in model.layers):
        return None
    t, dtype, threads, cap = key[:4]
    fixed = key[-2]
    # the GEMMs whose gate|up calls prefetch side rows: the bodies measured, AVX512-BF16 (not
    # the AMX tiles, which a bf16 call at cap 3 takes) and VNNI (int8 calls cap at 2 unless
    # KVSTRATA_CPU_INT8_GEMM=amx: then the tiles take the job without prefetching)
    side_gemms = {gemm.linear: gemm for gemm in (_bf16_ops, _int8_ops) if key[-1]
                  and gemm.kernel_isa(cap if gemm is _bf16_ops else min(cap, 2)) == 2}
    d = model.dims
    nq, nkv, hd, hidden = d.num_heads, d.num_kv_heads, d.head_dim, d.hidden_size
    eps = float(d.rms_norm_eps)
    q_end, k_end = nq * hd, (nq + nkv) * hd
    inter = d.intermediate_size
    code = cpu_ops.DTYPES[dtype]

    def buf(width: int) -> torch.Tensor:
        return torch.empty(t, width, dtype=dtype)
    x, h, qkv, attn, o, act, down = (buf(hidden), buf(hidden), buf(k_end + nkv * hd),
                                     buf(nq * hd), buf(hidden), buf(inter), buf(hidden))
    gate_up: torch.Tensor | None = None  # made when a layer's silu is a pass of its own
    backend = model.attn_backend
    pool = _pool(backend)
    index = dict(dtype=torch.int64)
    plan = DecodePlan(x, torch.empty(t * hd, dtype=dtype), torch.empty(t * hd, dtype=dtype),
                      torch.empty(t, **index), torch.empty(capacity, **index),
                      torch.empty(t + 1, **index), [])
    plan.swa_slots = pool is backend.swa_pool
    scatter0 = pool.scatter_args(0, plan.out_slots, qkv[:, q_end:k_end].view(t, nkv, hd),
                                 qkv[:, k_end:].view(t, nkv, hd))
    _, decode0 = paged_decode.decode_args(qkv[:, :q_end].view(t, nq, hd), pool.k(0),
                                          pool.v(0), plan.slots, plan.starts, backend.scale,
                                          out=attn.view(t, nq, hd), num_threads=threads,
                                          fixed=fixed)
    if scatter0 is None:
        return None
    row_bytes = pool.k(0)[0].numel() * pool.k(0).element_size()  # one token, all KV heads
    rope = (_cpu_ops.rope, (qkv.data_ptr(), qkv.shape[1], t, nq + nkv, hd,
                            plan.cos.data_ptr(), plan.sin.data_ptr(), code, threads, cap))
    norm = _cpu_ops.rms_norm_bf16 if dtype == torch.bfloat16 else _cpu_ops.rms_norm_f32
    add_norm = (_cpu_ops.add_rms_norm_bf16 if dtype == torch.bfloat16
                else _cpu_ops.add_rms_norm_f32)
    for i, layer in enumerate(model.layers):
        up_lin = layer.gate_up_weight
        fused_silu = _fused_silu(up_lin, t)
        if not fused_silu and gate_up is None:
            gate_up = buf(2 * inter)
        linears = (
            _linear_call(model, layer.qkv_weight, layer.qkv_bias, h, qkv, threads, cap),
            _linear_call(model, layer.o_weight, layer.o_bias, attn, o, threads, cap),
            _linear_call(model, up_lin, layer.gate_up_bias, h,
                         act if fused_silu else gate_up, threads, cap, silu=fused_silu),
            _linear_call(model, layer.down_weight, layer.down_bias, act, down, threads, cap))
        first = ((norm, (x.data_ptr(), hidden, t, hidden, layer.input_norm.data_ptr(),
                         h.data_ptr(), eps, threads, cap)) if i == 0 else
                 (add_norm, (x.data_ptr(), down.data_ptr(), t, hidden,
                             layer.input_norm.data_ptr(), h.data_ptr(), eps, threads, cap)))
        shift = i * pool.layer_bytes
        scatter = (scatter0[0] + shift, scatter0[1] + shift) + scatter0[2:]
        decode = list(decode0)
        decode[4], decode[5] = pool.k(i).data_ptr(), pool.v(i).data_ptr()
        plan.decode_args.append(decode)
        # a NoPE layer (SmolLM3's no_rope_layers) writes and reads its q / k unrotated
        calls = [first, linears[0], *(() if i in model.nope_layers else (rope,)),
                 (_rowcopy.scatter_kv, scatter),
                 (paged_decode.run_decode, (decode,)), linears[1],
                 (add_norm, (x.data_ptr(), o.data_ptr(), t, hidden, layer.post_norm.data_ptr(),
                             h.data_ptr(), eps, threads, cap))]
        gemm = side_gemms.get(linears[2][0])
        if gemm is not None and i + 1 < len(model.layers):
            # the gate|up GEMM (compute-bound at decode batches) brings the next layer's K
            # and V rows into the caches, which its attention then reads: bf16 B=32 C=190
            # steps 1.05-1.06x, C=512 1.04x, B=8 1.02x, B=1 1.00x; w8a8 B=32 1.12x (AVX-512
            # BF16 EPYC, 2 threads, interleaved in one process; AVX2 / AMX: not measured)
            side = [pool.k(i + 1).data_ptr(), pool.v(i + 1).data_ptr(), row_bytes,
                    plan.slots.data_ptr(), 0]
            plan.side_args.append(side)
            calls.append((gemm.prefetch_rows_next, side))
        calls.append(linears[2])
        if not fused_silu:
            calls.append((_cpu_ops.silu_mul, (gate_up.data_ptr(), 2 * inter, t, inter,
                                              act.data_ptr(), code, threads, cap)))
        calls.append(linears[3])
        plan.layers.append(calls)
    plan.scratch = [h, qkv, attn, o, act, gate_up, down]  # down last: run() adds it
    return plan
