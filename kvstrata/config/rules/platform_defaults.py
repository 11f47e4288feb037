"""Step 0: values whose default depends on the platform: device, chunked prefill size, and
--dtype auto on a CPU (chosen from the CPU's instruction sets by the measurements below)."""
from __future__ import annotations

from typing import NamedTuple

from kvstrata.config.hf_quant import PACKED_METHODS
from kvstrata.config.server_args import QUANTIZATION_AT_LOAD
from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, change
from kvstrata.platform import VNNI_FLAGS, Platform

# A CPU prefill is slow per token, so smaller chunks keep decode latency of running requests
# bounded; accelerators amortise launch cost over bigger chunks (SGLang's GPU default 8192).
CHUNKED_PREFILL_CPU = 2048
CHUNKED_PREFILL_ACCELERATOR = 8192

# --dtype auto on a CPU: the first row whose flags the CPU has (all of `needs`, none of
# `lacks`; with --quantization only rows measured with it) decides, else float32. A row
# holds up to `max_threads` torch threads (None: any; an unknown count, 0, takes the row),
# or any count while KVSTRATA_CPU_BF16_GEMM is one of `any_threads_with` and the model is
# not quantized (`why_any` says why; w8a8 in bf16 was not measured there); above them the
# CPU keeps float32 for the reason `beyond`; with a KVSTRATA_CPU_BF16_GEMM choice outside
# `gemms` too. Each row is backed by a serving measurement
# (kvstrata bench serve, SmolLM2, 64 prompts, 32 concurrent, in 128, out 64;
# benchmarks/run_vllm_cpu.sh, docs/benchmarks.md "CPU speed per ISA").
class DtypeRow(NamedTuple):
    needs: tuple[str, ...]
    lacks: tuple[str, ...]
    quantized_too: bool
    dtype: str
    max_threads: int | None
    why: str
    beyond: str = ""
    any_threads_with: tuple[str, ...] = ()
    why_any: str = ""
    gemms: tuple[str, ...] = ()  # the KVSTRATA_CPU_BF16_GEMM choices measured (empty: any)


AMX_BF16_MAX_THREADS = 8
AVX2_BF16_MAX_THREADS = 2
AVX2_BF16_GEMMS = ("auto", "own")
AVX2_BF16_WHY = ("kvstrata's AVX2 bf16 kernels: serving measured bf16 1.00-1.21x fp32 at 32 "
                 "concurrent requests (eight rounds, median 1.07x), 1.30x at 8 and 1.49x at 1, "
                 "at 2 threads (2026-12-04)",
                 "bf16 is measured at 1-2 threads only (--dtype bfloat16 takes it)")
CPU_DTYPE_RULES = (
    # AMX: 2.35-2.42x on a 2-vCPU Xeon VM (2026-12-02) with oneDNN's bf16 linears, but 0.80x
    # on 16 cores of an H200 host's Xeon (2026-12-04, torch 2.11, SmolLM2's shapes): there
    # oneDNN's AMX linears at decode rows did not scale with the cores (B=32 step 40-55 ms,
    # fp32 30 ms). With kvstrata's bf16 GEMM for decode rows beside oneDNN's AMX tiles for
    # prefill (runner/cpu/packed_linear.py split_layouts, the default there) bf16 served
    # 1.13-1.33x fp32 at 16 threads (three rounds) and 0.91x / 1.44x at 8 (two, noisy); with
    # that GEMM on the AMX tiles (runner/cpu/csrc/bf16_gemm_amx.h) and bf16 prefill attention on
    # kvstrata's kernel, 1.83-2.15x at 16 (three rounds, median 1.90x; 8 not measured).
    # With oneDNN's alone (KVSTRATA_CPU_BF16_GEMM=onednn) or the own GEMM alone (own: 0.92-1.10x
    # at 16) the 8-thread bound stands: 3-15 threads are not measured, it sits between.
    DtypeRow(("amx_bf16",), (), True, "bfloat16", AMX_BF16_MAX_THREADS,
             "AMX bf16 tiles: serving measured bf16 2.35-2.42x fp32 at 2 threads (2026-12-02)",
             "serving measured bf16 on oneDNN's linears alone 0.80x fp32 at 16 threads "
             "(2026-12-04; 2.35-2.42x at 2)",
             ("auto", "own_decode"),
             "AMX bf16 tiles for prefill and kvstrata's bf16 GEMM for decode rows: serving "
             "measured bf16 1.83-2.15x fp32 at 16 threads (three rounds, median 1.90x, "
             "2026-12-04), 2.35-2.42x at 2 on oneDNN's alone (2026-12-02)"),
    DtypeRow(("avx512_bf16",), (), True, "bfloat16", None, "AVX-512 BF16: bf16 GEMMs 1.8-3.5x "
             "fp32, serving measured bf16 1.4-2.3x fp32 over eleven rounds on a 2-vCPU EPYC "
             "(2026-12-03), 1.84x (median of fourteen, 1.59-1.91x) on a 2-vCPU Zen 4 EPYC "
             "(2026-12-05)"),
    # AVX2 + FMA + F16C without AVX-512 (and without AVX-NE-CONVERT, with which oneDNN may
    # take bf16 linears): kvstrata's own bf16 kernels run there. Its serving rounds moved
    # with the box: 0.83x fp32 (session 18), 1.00-1.60x (session 23, bf16 picked for a day),
    # 0.92-0.94x after fp32's decode plan took batches above 16 rows (session 24), 0.91-1.14x
    # after fp32's own GEMM (session 25), all from separate servers run one after the other.
    # Session 30 measured both dtypes in one process, interleaved (benchmarks/ab_dtype.py):
    # bf16 faster at every shape, decode steps 1.85x (batch 1), 1.5x (8), 1.16x (32), 1.15x
    # (64), prefill 1.07x (16 x 158 tokens) and 1.15x (2048), the same ratios at 1 thread;
    # served, eight rounds at 32 concurrent 1.00-1.21x (median 1.07x), 1.30x at 8 and 1.49x
    # at 1 (two rounds each); w8a8 in bf16 1.02-1.04x its fp32 (two rounds). Measured on 2
    # vCPUs only: kvstrata's bf16 GEMM splits its work differently from oneDNN's fp32 layer
    # that prefill rows take in fp32, so more threads keep fp32 until measured.
    # With AVX-VNNI a w8a8 layer runs oneDNN's int8 path, not the AVX2 int8 tile measured
    # here in bf16: that CPU takes the second row, unquantized only.
    # KVSTRATA_CPU_BF16_GEMM=onednn / own_decode put bf16 linears (all, or prefill rows) on
    # torch's bf16 F.linear there, ~50x slower: fp32.
    DtypeRow(("avx2", "fma", "f16c"), ("avx512f", "avx_ne_convert", "avx_vnni"), True,
             "bfloat16", AVX2_BF16_MAX_THREADS, *AVX2_BF16_WHY, gemms=AVX2_BF16_GEMMS),
    DtypeRow(("avx2", "fma", "f16c"), ("avx512f", "avx_ne_convert"), False, "bfloat16",
             AVX2_BF16_MAX_THREADS, *AVX2_BF16_WHY, gemms=AVX2_BF16_GEMMS),
)
CPU_DTYPE_FALLBACK = ("float32", "no bf16 path measured faster than fp32 on this CPU (no "
                      "avx512_bf16 / amx_bf16, nor AVX2 + FMA + F16C without AVX-512 or "
                      "AVX-NE-CONVERT; AVX-512 without bf16 instructions: not measured)")


def int8_takes_model_dtype(platform: Platform, env: dict) -> bool:
    """--quantization w8a8_int8 runs runner/cpu/int8_linear.py's layer (with VNNI, or kvstrata's
    GEMM on its AVX2 tile without VNNI), which quantises bf16 or fp32 activations alike: the
    dtype rows below apply to it as to a float model."""
    enabled = env.get("KVSTRATA_CPU_INT8_MM", True)  # envs.snapshot(): parsed values
    flags = set(platform.cpu_flags)
    if VNNI_FLAGS & flags:
        return enabled is True
    gemm = str(env.get("KVSTRATA_CPU_INT8_GEMM", "auto")).strip().lower()
    return enabled is True and gemm in ("auto", "own") and {"avx2", "fma", "f16c"} <= flags


PROBE_CHOICES = ("auto", "on", "off")


def probe_choice(env: dict) -> str:
    choice = str(env.get("KVSTRATA_CPU_DTYPE_PROBE", "auto")).strip().lower()
    if choice not in PROBE_CHOICES:
        raise ValueError(f"KVSTRATA_CPU_DTYPE_PROBE={choice!r} is not one of "
                         f"{', '.join(PROBE_CHOICES)}")
    return choice


def cpu_dtype(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
              env: dict) -> tuple[str, str]:
    """(dtype, reason) for --dtype auto on a CPU: the table's row, or where the table has
    none for this CPU and thread count (or KVSTRATA_CPU_DTYPE_PROBE=on) the start-up
    measurement serve and LLM() attach to the platform (runner/cpu/dtype_probe.py)."""
    dtype, why, open_ = table_dtype(args, platform, model_info, env)
    if not probe_allowed(args, model_info, env) or not (open_ or probe_choice(env) == "on"):
        return dtype, why
    if platform.cpu_dtype_measured is not None:
        return platform.cpu_dtype_measured
    if open_:
        why += ("; not measured yet: serve and LLM() time bf16 against fp32 linears at "
                "start-up (KVSTRATA_CPU_DTYPE_PROBE)")
    return dtype, why


def probe_allowed(args: ResolvedArgs, model_info: ModelInfo | None, env: dict) -> bool:
    """A start-up measurement may choose the dtype: one unquantized llama-family model on one
    server. TP ranks and a PD pair would each measure alone and might disagree on the
    dtype their KV bytes must share."""
    if (env.get("KVSTRATA_CPU_AUTO_DTYPE") or "").strip() or probe_choice(env) == "off":
        return False
    return (args.quantization is None and args.tp_size == 1
            and args.disaggregation_mode in (None, "null")
            and (model_info is None or model_info.kv_pool_kind == "mha"))


def wants_probe(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                env: dict) -> bool:
    """Whether serve / LLM() should measure the dtype before resolving: --dtype auto on a
    CPU whose table row leaves it open (or KVSTRATA_CPU_DTYPE_PROBE=on)."""
    if args.dtype != "auto" or (args.device or platform.device_type) != "cpu":
        return False
    if not probe_allowed(args, model_info, env):
        return False
    return probe_choice(env) == "on" or table_dtype(args, platform, model_info, env)[2]


def table_dtype(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                env: dict) -> tuple[str, str, bool]:
    """(dtype, reason, open): open when no measured row decides for this CPU and thread
    count (the fallback, or above a row's threads) for an unquantized model."""
    forced = (env.get("KVSTRATA_CPU_AUTO_DTYPE") or "").strip()
    if forced:
        if forced not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"KVSTRATA_CPU_AUTO_DTYPE={forced!r} is not float32, bfloat16 "
                             "or float16 (or empty: chosen from the CPU)")
        return forced, f"KVSTRATA_CPU_AUTO_DTYPE={forced}", False
    if args.quantization == "gguf":
        return "float32", ("--quantization gguf: the packed GGUF matmul "
                           "(runner/cpu/gguf_matmul.py) returns float32; bf16 activations are "
                           "not measured with it"), False
    if model_info is not None and model_info.quant_method in PACKED_METHODS:
        return "float32", (f"a {model_info.quant_method} checkpoint: its weights run on the "
                           "packed GGUF matmul (runner/cpu/gguf_matmul.py), which returns "
                           "float32; bf16 activations are not measured with it"), False
    if args.quantization in QUANTIZATION_AT_LOAD and not int8_takes_model_dtype(platform, env):
        return "float32", (f"--quantization {args.quantization}: without VNNI (or with "
                           "KVSTRATA_CPU_INT8_MM=0) its int8 kernel takes float32 "
                           "activations"), False
    if model_info is not None and model_info.kv_pool_kind != "mha":
        return "float32", (f"a {model_info.kv_pool_kind} model: only the llama-family "
                           "decoder is measured in bf16 on CPU"), False
    flags, threads = set(platform.cpu_flags), platform.cpu_threads
    gemm = str(env.get("KVSTRATA_CPU_BF16_GEMM", "auto")).strip().lower()
    unquantized = args.quantization is None
    for row in CPU_DTYPE_RULES:
        if set(row.needs) <= flags and not set(row.lacks) & flags:
            has = " + ".join(row.needs)
            if row.gemms and gemm not in row.gemms:
                return "float32", (f"the CPU has {has}, but KVSTRATA_CPU_BF16_GEMM={gemm} "
                                   "takes bf16 linears off kvstrata's GEMM measured there"), False
            if not unquantized and not row.quantized_too:
                return "float32", (f"--quantization {args.quantization}: this CPU's bf16 row "
                                   f"({has}) is measured unquantized only"), False
            if gemm in row.any_threads_with and unquantized:
                return row.dtype, f"the CPU has {has}: {row.why_any}", False
            if row.max_threads is not None and threads > row.max_threads:
                if gemm in row.any_threads_with:
                    why = (f"--quantization {args.quantization} is not measured in bf16 "
                           f"above {row.max_threads} threads")
                elif row.any_threads_with:  # the bound depends on the GEMM choice
                    why = f"with KVSTRATA_CPU_BF16_GEMM={gemm} {row.beyond}"
                else:
                    why = row.beyond
                return "float32", (f"the CPU has {has} but runs {threads} threads (bf16 holds "
                                   f"up to {row.max_threads}): {why}"), unquantized
            return row.dtype, f"the CPU has {has}: {row.why}", False
    return (*CPU_DTYPE_FALLBACK, unquantized)


def platform_defaults(args: ResolvedArgs, platform: Platform,
                      model_info: ModelInfo | None, env: dict) -> list[Resolution]:
    out: list[Resolution] = []
    if args.device is None:
        out += change(args, "device", platform.device_type, "platform.device",
                      f"--device unset: the {platform.kind} platform runs on "
                      f"'{platform.device_type}' devices")
    elif args.device not in ("cpu", platform.device_type):
        usable = " or ".join(dict.fromkeys((platform.device_type, "cpu")))
        raise ValueError(f"--device {args.device} is not available on the {platform.kind} "
                         f"platform (use {usable})")
    if args.chunked_prefill_size is None:
        device = args.device or platform.device_type
        base = CHUNKED_PREFILL_CPU if device == "cpu" else CHUNKED_PREFILL_ACCELERATOR
        # Chunks are cut to whole pages: align the default (rules/page_geometry.py refuses
        # an explicit size that is not a multiple of the page, as SGLang does).
        size = max(args.page_size, base // args.page_size * args.page_size)
        aligned = f", aligned to whole pages of --page-size {args.page_size}" \
            if size != base else ""
        out += change(args, "chunked_prefill_size", size, "platform.chunked_prefill_size",
                      f"--chunked-prefill-size unset: {base} on "
                      f"{'CPU' if device == 'cpu' else 'an accelerator'}{aligned}")
    if args.dtype == "auto" and (args.device or platform.device_type) == "cpu":
        dtype, why = cpu_dtype(args, platform, model_info, env)
        out += change(args, "dtype", dtype, "platform.cpu_dtype", f"--dtype auto on CPU: {why}")
    return out
