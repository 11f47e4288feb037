"""Decode attention over the paged KV pool in one pass (the C extension `_paged_decode`).

Why: a decode step reads every running request's whole context in every layer. Gathering it
into a contiguous copy for SDPA moves each K/V row three times (read, write the copy, SDPA
reads it back); at batch 32 and 512 tokens of context the gather + SDPA measured ~2.5x the
layer's GEMMs (1 thread, SmolLM2 shapes). The kernel reads each row once, straight from the
pool through the request's slots (csrc/paged_decode.c), and scores the query heads that share
a KV head together.

Pools of fp32, bf16 or fp16: each row is widened to fp32 in L1 (scores, softmax and the
weighted sum run in fp32), so a 16-bit pool halves the bytes read, which is what bounds decode
attention. The vector code is picked per call from the CPU's flags (AVX-512, AVX2 + FMA +
F16C, or scalar; KVSTRATA_CPU_ISA caps it for tests), never fixed at build time.

Threads: the kernel's OpenMP region runs on torch's own OpenMP team (its libgomp), with
torch's thread count. An earlier version used pthreads of its own, which fought torch's
spinning OpenMP workers for the cores (2 threads: the decode step 3x slower), so it ran on one
thread and left the other core idle.
"""
from __future__ import annotations

import torch

from kvstrata.runner.attention import _paged_decode
from kvstrata.runner.cpu.isa import isa_cap

KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
Q_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the query's and the output's


def supported(kv_dtype: torch.dtype, q_dtype: torch.dtype, device: torch.device) -> bool:
    """The kernel reads pools of these dtypes; the query is widened to fp32 on the way in."""
    return kv_dtype in KV_DTYPES and q_dtype in KV_DTYPES and device.type == "cpu"


def kernel_isa(head_dim: int, kv_dtype: torch.dtype) -> str:
    """The instruction set a call with this head size and pool dtype runs on this CPU."""
    return _paged_decode.isa(head_dim, KV_DTYPES[kv_dtype], isa_cap())


def _addr(name: str, t: torch.Tensor, dtypes) -> int:
    if t.dtype not in dtypes or t.device.type != "cpu" or not t.is_contiguous():
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must be a contiguous {want} CPU tensor, got {t.dtype} on "
                         f"{t.device}, contiguous={t.is_contiguous()}")
    return t.data_ptr()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor, starts: torch.Tensor, scale: float,
                 out: torch.Tensor | None = None, num_threads: int | None = None,
                 ends: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                 softcap: float = 0.0, fixed: bool = False) -> torch.Tensor:
    """q [n, Hq, D] fp32 or bf16 (its rows may be strided, as a view of a fused qkv
    projection; each row's Hq x D values contiguous); k_cache / v_cache [num_slots, Hkv, D]
    (one layer of the pool: fp32, bf16 or fp16, both the same); request b attends to the
    keys at slots[starts[b]:starts[b + 1]] (int64; starts has n + 1 entries), or with `ends`
    (n int64s) at slots[starts[b]:ends[b]] (n starts; ranges may overlap: every query of a
    prompt over one slot list, each up to its own position). Returns out [n, Hq, D] in q's
    dtype (fp32 inside). num_threads: default torch's thread count. sinks: fp32 [Hq], a
    learned logit per query head that joins its softmax without a value (gpt-oss); softcap
    > 0: each scaled score becomes softcap * tanh(score / softcap) before the softmax
    (Gemma 2); 0: none.

    A query's result depends only on its own row, keys and values: not on the other
    queries of the call, their number or the threads (no split of a query's keys).
    fixed: each query runs as a one-row prompt of prefill_attention (csrc/decode_fixed.h:
    its key blocks, online softmax and rounding), so it comes out bit-identical to the same
    row of a prompt there (deterministic inference, runner/attention/torch_native.py); q and
    the caches of one dtype, fp32 or bf16, no sinks or softcap."""
    return _checked(q, k_cache, v_cache, slots, starts, scale, out, num_threads, ends, sinks,
                    softcap, fixed)[0]


def _checked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, starts: torch.Tensor, scale: float,
             out: torch.Tensor | None = None, num_threads: int | None = None,
             ends: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
             softcap: float = 0.0, fixed: bool = False) -> tuple[torch.Tensor, list]:
    """paged_decode, also returning the kernel's arguments (DecodeCall keeps them)."""
    out, args = decode_args(q, k_cache, v_cache, slots, starts, scale, out, num_threads, ends,
                            sinks, softcap, fixed)
    run_decode(args)
    return out, args


def decode_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor, starts: torch.Tensor, scale: float,
                out: torch.Tensor | None = None, num_threads: int | None = None,
                ends: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                softcap: float = 0.0, fixed: bool = False) -> tuple[torch.Tensor, list]:
    """paged_decode's checks and the kernel's arguments for these tensors, nothing run: (out,
    args) for `run_decode(args)`. Pointers sit at args[0] (q), [4] / [5] (k / v caches),
    [16] (out) and [21] (sinks, 0: none): a caller with other tensors of the same shapes may
    swap them in."""
    n, hq, d = q.shape
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3 or k_cache.shape[2] != d:
        raise ValueError(f"k/v caches must both be [slots, Hkv, {d}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k/v caches differ in dtype: {k_cache.dtype} vs {v_cache.dtype}")
    want = n if ends is not None else n + 1
    if starts.numel() != want or (ends is not None and ends.numel() != n):
        raise ValueError(f"starts must have {want} entries, got {starts.numel()}"
                         + ("" if ends is None else f"; ends {n}, got {ends.numel()}"))
    q_stride = row_stride(q)
    if q.dtype not in Q_DTYPES or q.device.type != "cpu" or q_stride is None:
        raise ValueError(f"q must be an fp32 or bf16 CPU tensor whose rows hold Hq x D "
                         f"contiguous values, got {q.dtype} on {q.device}, strides "
                         f"{tuple(q.stride())}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    elif out.dtype != q.dtype:
        raise ValueError(f"out must have q's dtype {q.dtype}, got {out.dtype}")
    if sinks is not None and (sinks.shape != (hq,) or sinks.dtype != torch.float32):
        raise ValueError(f"sinks must be fp32 [{hq}] (one logit per query head), got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0: none), got {softcap}")
    threads = torch.get_num_threads() if num_threads is None else num_threads
    args = [q.data_ptr(), _bytes_from(q), q_stride, Q_DTYPES[q.dtype],
            _addr("k_cache", k_cache, KV_DTYPES), _addr("v_cache", v_cache, KV_DTYPES),
            k_cache.numel() * k_cache.element_size(), KV_DTYPES[k_cache.dtype],
            _addr("slots", slots, (torch.int64,)), slots.numel(),
            _addr("starts", starts, (torch.int64,)), n, hq, k_cache.shape[1], d, float(scale),
            _addr("out", out, (q.dtype,)), out.numel() * out.element_size(), threads, isa_cap(),
            0 if ends is None else _addr("ends", ends, (torch.int64,)),
            0 if sinks is None else _addr("sinks", sinks, (torch.float32,)),
            0 if sinks is None else hq, float(softcap), int(fixed)]
    return out, args


def _bytes_from(q: torch.Tensor) -> int:
    """Bytes of q's storage from its first element on (the C kernel's bound for its rows)."""
    return q.untyped_storage().nbytes() - q.storage_offset() * q.element_size()


def run_decode(args: list | tuple) -> None:
    """The kernel over decode_args' arguments (named in torch's profiler when it runs)."""
    if torch.autograd._profiler_enabled():  # a named op in profiles (costs ~30 us a call)
        with torch.profiler.record_function("kvstrata::paged_decode"):
            _paged_decode.decode(*args)
    else:
        _paged_decode.decode(*args)


class DecodeCall:
    """paged_decode for every layer of one forward. The first call checks everything (as
    paged_decode) and keeps the kernel's arguments; a later call whose q and caches have the
    same shapes, strides, dtypes and byte extents (checked: a tuple compare) swaps in their
    addresses and a new output (and the layer's sink logits: each layer has its own). Why: paged_decode's checks cost ~14 us of a ~16 us call at
    one token (2-vCPU EPYC), ~0.4 ms of a 30-layer decode step."""

    def __init__(self, slots: torch.Tensor, starts: torch.Tensor, scale: float,
                 ends: torch.Tensor | None = None, fixed: bool = False):
        self.slots, self.starts, self.scale, self.ends = slots, starts, scale, ends
        self.fixed = fixed  # paged_decode's `fixed`: the prefill kernel's order
        self.key: tuple | None = None
        self.args: list | None = None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
        key = (q.shape, q.stride(), q.dtype, q.device, _bytes_from(q), k_cache.shape,
               k_cache.stride(), v_cache.shape, v_cache.stride(), k_cache.dtype, v_cache.dtype,
               k_cache.device, v_cache.device, torch.get_num_threads(), isa_cap(), softcap,
               None if sinks is None else (sinks.shape, sinks.dtype, sinks.device,
                                           sinks.is_contiguous()))
        if key != self.key:
            out, self.args = _checked(q, k_cache, v_cache, self.slots, self.starts, self.scale,
                                      ends=self.ends, sinks=sinks, softcap=softcap,
                                      fixed=self.fixed)
            self.key = key
            return out
        out = torch.empty(q.shape, dtype=q.dtype)
        args = self.args.copy()
        args[0], args[4], args[5], args[16] = (q.data_ptr(), k_cache.data_ptr(),
                                               v_cache.data_ptr(), out.data_ptr())
        if sinks is not None:
            args[21] = sinks.data_ptr()
        run_decode(args)
        return out


def row_stride(t: torch.Tensor) -> int | None:
    """Elements between consecutive tokens of a [n, H, D] tensor whose heads of one token
    are contiguous; None when they are not."""
    n, h, d = t.shape
    if t.stride(2) != 1 or (h > 1 and t.stride(1) != d):
        return None
    return t.stride(0) if n > 1 else h * d


PREFILL_MAX_HEAD_DIM = 256  # csrc/prefill_attention.h PF_MAX_D
PREFILL_MIN_TOKENS = 8  # below, SDPA's fixed cost is lower (1 token: 12 vs 26 us)


def prefill_supported(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether prefill_attention beats torch's flash attention here, by the rule measured with
    SmolLM2's 9/3 heads of 64 on 2 threads (kernel vs SDPA, same run): on an AVX-512 box
    without AMX 2.4-2.9x at 128-512 tokens and 1.8-1.9x at 2048 (fp32 and bf16); on an
    AVX2-only EPYC ~1.9x at 128 tokens, 1.7-2.0x at 512 and 1.05-1.2x at 2048. Its vector
    code needs AVX2 + FMA and head_dim % 32 == 0 (the AVX-512 code head_dim % 64 == 0, else
    it runs the AVX2 code), head_dim <= 256. With AMX-BF16, bf16 prompts up to
    prefill_max_tokens only. bf16 on AVX512-BF16 (its vdpbf16ps step, session 35, an AVX-512
    BF16 EPYC): 3.5x SDPA at 157-512 tokens, 2.2x at 2048."""
    return (device.type == "cpu" and dtype in Q_DTYPES
            and prefill_kernel_isa(head_dim) != "scalar")


# On a CPU with AMX-BF16 torch's flash attention multiplies bf16 blocks on the tiles. On 16
# cores of an H200 host's Emerald Rapids (2026-12-04, bench_prefill_attention.py, one prompt,
# SmolLM2's 9/3 heads of 64) the kernel ran 0.95x SDPA at 128 tokens, 1.10x at 512 and 0.67x
# at 2048, while in a served-like prefill (13 prompts of 157 tokens, bench_decode_step.py) SDPA
# and the copies around its per-prompt calls took ~40% of the bf16 forward: the kernel takes
# one call a layer for all of them. Longer prompts stay on SDPA.
AMX_BF16_PREFILL_MAX_TOKENS = 1024


def prefill_max_tokens(dtype: torch.dtype) -> int | None:
    """The longest prompt (cached prefix + new tokens) the prefill kernel takes at this dtype
    on this CPU; None: any."""
    if dtype == torch.bfloat16 and "amx_bf16" in _cpu_flags():
        return AMX_BF16_PREFILL_MAX_TOKENS
    return None


def fixed_order_pays(kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether deterministic inference runs every full-attention query in the prefill kernel's
    order here (torch_native.py `fixed_order`) rather than the decode kernel's: a bf16 pool on
    the prefill kernel's AVX512-BF16 body. Attention alone, 1 thread, CPU time
    (benchmarks/bench_deterministic_attention.py, AVX-512 BF16 EPYC, 2026-12-07): there a
    prompt ran 1.5-2.2x faster (32 x 128 to 1 x 2000 tokens) and a decode row 1.1-1.5x
    slower (it transposes every key block it reads once); at fp32 prompts gained 1.06-1.7x
    and decode rows lost 1.4-5x, so fp32 (and the bodies not measured) keep the decode
    kernel's order."""
    return (kv_dtype == torch.bfloat16 and prefill_kernel_isa(head_dim) == "avx512"
            and "avx512_bf16" in _cpu_flags())


def prefill_kernel_isa(head_dim: int) -> str:
    """The instruction set prefill_attention runs for this head size on this CPU (scalar:
    no vector code fits; the kernel still answers, slowly)."""
    return _paged_decode.prefill_isa(head_dim, isa_cap())


def _cpu_flags() -> frozenset:
    from kvstrata.platform import read_cpu_flags
    return read_cpu_flags()


def prefill_seqs(seqs: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """prefill_attention's prompt table: (q_lo, q_hi, slot_off, prefix) rows as int64 (built
    once per forward, used by every layer)."""
    return torch.tensor(seqs, dtype=torch.int64).reshape(-1, 4)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor, seqs: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None,
                      num_threads: int | None = None) -> torch.Tensor | None:
    """Causal attention of a batch's prompts (or prompt chunks after a cached prefix): q
    [T, Hq, D] (a view of the fused qkv projection is read in place), keys and values from
    one layer of the pool, k_cache / v_cache [rows, Hkv, D], where the step's tokens are
    already written. seqs (prefill_seqs): (q_lo, q_hi, slot_off, prefix) per prompt: query
    rows [q_lo, q_hi) are positions prefix .. and attend to positions 0 .. their own,
    position c at pool row slots[slot_off + c] (int64; the kernel checks every bound). Writes those rows of `out` [T, Hq, D] (q's dtype; new if
    None) and returns it, or None when the tensors do not fit the kernel (callers use SDPA)."""
    n, hq, d = q.shape
    stride = row_stride(q)
    if (stride is None or k_cache.shape != v_cache.shape or k_cache.dim() != 3
            or k_cache.shape[2] != d or hq % k_cache.shape[1] or q.dtype not in Q_DTYPES
            or not (q.dtype == k_cache.dtype == v_cache.dtype)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or any(t.device.type != "cpu" for t in (q, k_cache, v_cache))):
        return None
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape "
                         f"{tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    for name, t in (("slots", slots), ("seqs", seqs)):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous int64 CPU tensor")
    if seqs.dim() != 2 or seqs.shape[1] != 4:
        raise ValueError(f"seqs must be [n, 4] (prefill_seqs), got {tuple(seqs.shape)}")
    threads = torch.get_num_threads() if num_threads is None else num_threads
    args = (q.data_ptr(), stride, n, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
            slots.data_ptr(), slots.numel(), seqs.data_ptr(), seqs.shape[0], hq,
            k_cache.shape[1], d, Q_DTYPES[q.dtype], float(scale), out.data_ptr(), threads,
            isa_cap())
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function("kvstrata::prefill_attention"):
            _paged_decode.prefill(*args)
    else:
        _paged_decode.prefill(*args)
    return out
