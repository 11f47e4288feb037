"""Typed registry of KVSTRATA_* environment variables.

Environment variables are for debugging and ablation switches only; anything a user should
normally set is a ServerArgs flag. Every variable is declared here once, with its type, default
and meaning, and read through `envs.NAME.get()` (or `envs.snapshot()` when a pure function
needs them as an explicit input, as the resolution pipeline does). A malformed value raises
ValueError naming the variable instead of silently becoming False.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

PREFIX = "KVSTRATA_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not a boolean "
                     f"(use one of 1/true/yes/on or 0/false/no/off)")


def _parser_for(name: str, kind: type) -> Callable[[str], Any]:
    if kind is bool:
        return lambda raw: _parse_bool(name, raw)

    def parse(raw: str) -> Any:
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not a valid "
                             f"{kind.__name__}") from None
    return parse


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: type
    default: Any
    help: str

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        env = os.environ if environ is None else environ
        raw = env.get(self.name)
        if raw is None:
            return self.default
        return _parser_for(self.name, self.kind)(raw)

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return self.name in (os.environ if environ is None else environ)


REGISTRY: dict[str, EnvVar] = {}


def _declare(name: str, kind: type, default: Any, help: str) -> EnvVar:
    assert name.startswith(PREFIX) and name not in REGISTRY, name
    var = EnvVar(name, kind, default, help)
    REGISTRY[name] = var
    return var


KVSTRATA_DSA_FUSE_TOPK = _declare(
    "KVSTRATA_DSA_FUSE_TOPK", bool, True,
    "Use the fused DSA top-k (indexer scores -> KV slots in one step). Input of the DSA gates "
    "resolved at start-up (see docs/configuration.md).")
KVSTRATA_PD_DSA_SEED = _declare(
    "KVSTRATA_PD_DSA_SEED", bool, True,
    "A PD decode server's NEXTN draft starts its first round from the prefill's DSA top-k "
    "seed; 0 = ignore shipped seeds (the first draft step runs the indexer: the benchmark's "
    "forced-recompute arm).")
KVSTRATA_CHECK_INTEGRITY = _declare(
    "KVSTRATA_CHECK_INTEGRITY", bool, False,
    "Check every KV invariant (pages, locks, rows, req_to_token) after each scheduler step "
    "and fail the step that breaks one (slow; the test suite runs with it on).")
KVSTRATA_DEBUG_SLOW_STEP = _declare(
    "KVSTRATA_DEBUG_SLOW_STEP", str, "",
    "Fault injection for tests of --watchdog-timeout: `N:SECONDS` makes the scheduler "
    "process sleep SECONDS inside its N-th engine step (1-based), as a stuck forward would.")
KVSTRATA_DEBUG_RANK_EXIT = _declare(
    "KVSTRATA_DEBUG_RANK_EXIT", str, "",
    "Fault injection for tests of a tensor-parallel start-up: `RANK:CODE` makes rank RANK's "
    "process (RANK > 0) log an error and exit with CODE before it joins the group, as a rank "
    "that fails to start would.")
KVSTRATA_LOG_RESOLUTIONS = _declare(
    "KVSTRATA_LOG_RESOLUTIONS", bool, True,
    "Log each start-up Resolution (field, old -> new, rule, reason) once at start; rewrites "
    "of explicit choices are logged as warnings even when this is off.")
KVSTRATA_ENGINE_FACTORY = _declare(
    "KVSTRATA_ENGINE_FACTORY", str, "kvstrata.entrypoints.engine_factory:build_engine",
    "module:function that builds the scheduler process's engine, called as f(server_args, "
    "defer_tokenizer=True) -> (engine, tokenizer) (tests inject fakes and faults through it).")
KVSTRATA_SCHEDULER_EAGER_TOKENIZER = _declare(
    "KVSTRATA_SCHEDULER_EAGER_TOKENIZER", bool, True,
    "The scheduler process loads its tokenizer (it decodes only to find stop strings) on a "
    "thread right after it reports ready; 0 = at the first request with stop strings, which "
    "then waits for it (~1.6 s of CPU saved per start where none comes: the test suite).")
KVSTRATA_MAX_REQUEST_BYTES = _declare(
    "KVSTRATA_MAX_REQUEST_BYTES", int, 32 << 20,
    "Largest HTTP request body the API server reads; larger bodies get 413.")
KVSTRATA_CPU_PAGED_DECODE = _declare(
    "KVSTRATA_CPU_PAGED_DECODE", bool, True,
    "CPU decode attention reads the KV pool (fp32, bf16 or fp16) in place with the paged "
    "decode kernel (runner/attention/paged_decode.py); 0 = gather each request's K/V, then "
    "SDPA (ablation).")
KVSTRATA_CPU_DETERMINISTIC_BLOCKS = _declare(
    "KVSTRATA_CPU_DETERMINISTIC_BLOCKS", bool, False,
    "1: under --enable-deterministic-inference, with a bf16 pool on the prefill kernel's "
    "AVX512-BF16 body (paged_decode.fixed_order_pays), every query of a full-attention layer "
    "without sinks or soft-capping, prompt or decode, runs in the prefill kernel's order "
    "(prompts in the prefill kernel, decode rows as one-row prompts of it: "
    "csrc/decode_fixed.h): faster for long prompts, slower for decode rows. 0 (default): "
    "every query as a paged decode kernel query over its own keys -- served SmolLM2 bf16 on "
    "an AVX-512 BF16 EPYC measured 1.070x the flag-off throughput this way and 0.962x with "
    "1 (docs/benchmarks.md).")
KVSTRATA_CPU_RECURRENT_STEP = _declare(
    "KVSTRATA_CPU_RECURRENT_STEP", bool, True,
    "The decode step of recurrent layers (Gated DeltaNet, Mamba2) updates the fp32 or bf16 "
    "state pool in place with the C kernel (runner/recurrent/fused_step.py); 0 = gather the "
    "slots, torch ops, scatter back (ablation).")
KVSTRATA_CPU_PREFILL_ATTENTION = _declare(
    "KVSTRATA_CPU_PREFILL_ATTENTION", bool, True,
    "CPU prefill attention (a prompt, or a chunk after a cached prefix, 8+ tokens) runs the "
    "prefill kernel (runner/attention/paged_decode.py prefill_attention, keys read from the "
    "pool) where it is faster than torch's SDPA (AVX-512 with head_dim % 64 == 0, or AVX2 + "
    "FMA with head_dim % 32 == 0; bf16 with AMX-BF16 for prompts up to 1024 tokens, SDPA's "
    "AMX tiles above); 0 = SDPA always (ablation).")
KVSTRATA_GGUF_INT8_ACTIVATIONS = _declare(
    "KVSTRATA_GGUF_INT8_ACTIVATIONS", bool, False,
    "1 = a GGUF file's weights kept quantized (--quantization gguf) multiply activations "
    "quantized to 8-bit blocks of 32 with integer dot products (runner/cpu/gguf_matmul.py "
    "matmul_q8): 1.13-1.30x faster served at batch 1, 0.51x at batch 32 (measured); the "
    "default (0) keeps float activations (gguf_matmul.matmul, gguf's exact dequantized "
    "weights times x). Both are batch-invariant. Read once at load.")
KVSTRATA_CPU_AUTO_DTYPE = _declare(
    "KVSTRATA_CPU_AUTO_DTYPE", str, "",
    "What --dtype auto means on a CPU: empty = chosen from the CPU's instruction sets "
    "(bfloat16 with avx512_bf16 / amx_bf16, or AVX2 + FMA + F16C without AVX-512 up to 2 "
    "threads, else float32; "
    "config/rules/platform_defaults.py), "
    "or float32 / bfloat16 / float16. The test suite sets float32 so its fp32 references hold "
    "on every machine.")
KVSTRATA_CPU_DTYPE_PROBE = _declare(
    "KVSTRATA_CPU_DTYPE_PROBE", str, "auto",
    "Where --dtype auto on a CPU has no measured row for the CPU and thread count "
    "(config/rules/platform_defaults.py: e.g. AVX-512 without bf16 instructions, AVX2 above "
    "2 threads), serve and LLM() time the model's linear layers in bf16 and fp32 at start-up "
    "and take bf16 if it is no slower at any row count measured and 1.05x faster over them "
    "(runner/cpu/dtype_probe.py; once per "
    "machine, cached under $XDG_CACHE_HOME/kvstrata). auto = there; on = on every CPU, "
    "over the table too; off = never (the table's float32).")
KVSTRATA_CPU_FUSED_OPS = _declare(
    "KVSTRATA_CPU_FUSED_OPS", bool, True,
    "The llama-family decoder on CPU runs RMSNorm (bf16 and fp32, alone or after the "
    "residual add), silu(gate) * up, the rotary embedding and the greedy argmax as one pass "
    "each (runner/cpu/fused_ops.py); 0 = torch's op sequences (ablation).")
KVSTRATA_CPU_DECODE_KV_PREFETCH = _declare(
    "KVSTRATA_CPU_DECODE_KV_PREFETCH", bool, True,
    "In a CPU decode plan (KVSTRATA_CPU_DECODE_PLAN) whose gate|up projection runs kvstrata's "
    "bf16 GEMM on AVX512-BF16 or its int8 GEMM on VNNI, that GEMM also prefetches the next "
    "layer's K and V rows of the step's requests, a line every k step, so that layer's "
    "decode attention reads them from the caches instead of RAM (runner/cpu/csrc/gemm_panels.h "
    "side_rows); 0 = off (ablation).")
KVSTRATA_CPU_DECODE_PLAN = _declare(
    "KVSTRATA_CPU_DECODE_PLAN", bool, True,
    "A CPU decode step of a llama-family model without per-head q/k norms runs each layer "
    "as calls bound once a forward: kvstrata's kernels as C calls, any other linear "
    "(oneDNN above the fp32 GEMV's rows, w8a8 int8 layers) as the model's own call copied "
    "into the plan's buffer (runner/models/decode_plan.py; bit-identical logits, ~4 ms "
    "less Python a SmolLM2 step); 0 = the per-op layer loop (ablation).")
KVSTRATA_CPU_GGUF_POOL = _declare(
    "KVSTRATA_CPU_GGUF_POOL", bool, True,
    "The packed GGUF GEMMs (runner/cpu/gguf_matmul.py) split a call over kvstrata's own "
    "worker threads, whose caller never waits for a worker that has not started "
    "(runner/cpu/csrc/gguf_pool.h); 0 = over torch's OpenMP team, a barrier per call "
    "(ablation).")
KVSTRATA_GGUF_Q8_SUPERBLOCKS = _declare(
    "KVSTRATA_GGUF_Q8_SUPERBLOCKS", bool, True,
    "With 8-bit activations (KVSTRATA_GGUF_INT8_ACTIVATIONS), Q4_K / Q5_K / Q6_K weights "
    "multiply x quantized in 256-value super-blocks with their sub-block scales kept as "
    "integers, one float step per super-block (runner/cpu/csrc/gguf_q8k_run.h); 0 = the "
    "32-value blocks every other format takes, a float step per 32 weights (ablation).")
KVSTRATA_CPU_ISA = _declare(
    "KVSTRATA_CPU_ISA", str, "auto",
    "Widest instruction set kvstrata's own CPU kernels may use: auto (the widest this CPU "
    "has, read at run time), amx (the bf16 GEMM's AMX-BF16 tiles; the same as auto), "
    "avx512 (no AMX), avx2 or scalar. For tests and ablations; a cap above what the CPU has "
    "still runs what it has.")
KVSTRATA_TP_HEARTBEAT_TIMEOUT = _declare(
    "KVSTRATA_TP_HEARTBEAT_TIMEOUT", float, 20.0,
    "Seconds a tensor-parallel rank may go without a heartbeat from its peers before it "
    "counts them lost (rank 0: the server exits non-zero; another rank: it exits).")
KVSTRATA_TP_SHM_ALLREDUCE = _declare(
    "KVSTRATA_TP_SHM_ALLREDUCE", bool, True,
    "Tensor-parallel ranks on one x86 CPU all-reduce through shared memory "
    "(runner/parallel/shm_allreduce.py); 0 = gloo for every collective (ablation).")
KVSTRATA_CPU_PACKED_LINEAR = _declare(
    "KVSTRATA_CPU_PACKED_LINEAR", bool, True,
    "Float32 / bf16 linear layers on the CPU run on packed weights (oneDNN's layout or "
    "kvstrata's bf16 GEMM, runner/cpu/packed_linear.py; a DeepSeek model's absorbed heads and "
    "MoE experts too, runner/models/deepseek_packed.py; the llama-family MoEs' and gpt-oss' "
    "experts: KVSTRATA_CPU_PACKED_EXPERTS); 0 = torch's F.linear on the plain weights "
    "(ablation).")
KVSTRATA_CPU_PACKED_EXPERTS = _declare(
    "KVSTRATA_CPU_PACKED_EXPERTS", bool, True,
    "Where the rest of the model is packed (KVSTRATA_CPU_PACKED_LINEAR), the llama-family "
    "MoEs' (runner/models/moe_decoder.py) and gpt-oss' router, routed experts and shared "
    "experts on packed linears too (runner/cpu/fixed_experts.py, pack_moe_layers); 0 = torch's "
    "F.linear on the plain expert stacks, the path before (ablation).")
KVSTRATA_CPU_INT8_MM = _declare(
    "KVSTRATA_CPU_INT8_MM", bool, True,
    "--quantization w8a8_int8 on a CPU with VNNI (or AVX2 + FMA + F16C without it) runs "
    "runner/cpu/int8_linear.py's layer in the model's dtype: an int8 GEMM between fused per-token "
    "quantise / dequantise rows; 0 = the fbgemm layer with float32 activations (ablation).")
KVSTRATA_CPU_INT8_GEMM = _declare(
    "KVSTRATA_CPU_INT8_GEMM", str, "auto",
    "The int8 GEMM of that layer: auto = kvstrata's own (runner/cpu/csrc/int8_gemm.h: rows "
    "quantised, multiplied and dequantised in one call) where the CPU has AVX512-VNNI "
    "(AMX-INT8 CPUs too: served 1.3-1.5x oneDNN's AMX path), or AVX2 + FMA + F16C and no "
    "VNNI (its AVX2 tile), and the shape fits (in % 4, out % 16), else oneDNN's (fbgemm's "
    "layer without VNNI); onednn = never kvstrata's (ablation); own = kvstrata's wherever one "
    "of its tiles runs, AVX-VNNI CPUs too (A/B); own_decode = kvstrata's up to 128 rows and "
    "oneDNN's above on a CPU with VNNI, both layouts kept (A/B for AMX prefill); amx = auto "
    "with the GEMM on AMX-INT8 tiles above 4 rows where the CPU has them "
    "(runner/cpu/csrc/int8_gemm_amx.h; A/B, not measured on an AMX machine yet). Read when "
    "the weights are packed.")
KVSTRATA_CPU_BF16_GEMM = _declare(
    "KVSTRATA_CPU_BF16_GEMM", str, "auto",
    "The GEMM of a bf16 model's linear layers on the CPU: auto = kvstrata's own "
    "(runner/cpu/csrc/bf16_gemm.c) where the CPU has AVX512-BF16, or AVX2 + FMA where oneDNN has "
    "no bf16 kernels, and the shape fits (in % 2, out % 16) -- with AMX-BF16 (where Linux "
    "grants the tile data: packed_linear.amx_bf16_ready, not the CPU's flags) on its AMX tiles "
    "(runner/cpu/csrc/bf16_gemm_amx.h) for up to 64 rows (decode batches), oneDNN's AMX tiles "
    "above (prefill), both layouts kept (twice the bf16 weights' memory) -- else oneDNN's "
    "prepacked one; onednn = always "
    "oneDNN's (ablation); own = kvstrata's for every row count wherever its AVX512-BF16 or "
    "AVX2 body runs (A/B); own_decode = the AMX split on any CPU with oneDNN bf16 (A/B). "
    "Read when the weights are packed.")
KVSTRATA_CPU_F32_GEMV = _declare(
    "KVSTRATA_CPU_F32_GEMV", str, "auto",
    "fp32 linear layers on the CPU: auto = kvstrata's GEMV (runner/cpu/csrc/f32_gemv.h) at 1-16 "
    "rows (decode at batch 1-16; 1-8 on an AVX-512 CPU) over a second copy of the layers' "
    "weights, where the CPU has AVX2 + FMA and the copies take at most 1/8 of RAM (they count "
    "as weights in the KV sizing), and on a CPU without AVX-512 kvstrata's fp32 GEMM over the "
    "same copy at 17-64 rows (bf16_gemm.c linear_f32; more rows stay oneDNN's); gemv = the "
    "GEMV only (oneDNN's prepacked layer above its rows); off = oneDNN's layer for every row "
    "count (no copies). "
    "Read when the weights are packed.")
KVSTRATA_CPU_HUGE_PAGES = _declare(
    "KVSTRATA_CPU_HUGE_PAGES", bool, True,
    "The CPU KV pool asks for transparent huge pages (madvise) before it is first written "
    "(kv/huge_pages.py: fewer TLB misses in decode attention); 0 = 4 KiB pages (ablation).")
KVSTRATA_BENCH_MAX_LOAD = _declare(
    "KVSTRATA_BENCH_MAX_LOAD", float, 0.5,
    "Benchmarks call the box busy when the 1-minute load average exceeds this per CPU: they "
    "warn loudly (or refuse with --require-quiet) and record it in their JSON.")
KVSTRATA_HICACHE_FILE_DIR = _declare(
    "KVSTRATA_HICACHE_FILE_DIR", str, "",
    "Root directory of the `file` HiCache storage backend when the extra config has no "
    "`file_path` (default: $XDG_CACHE_HOME/kvstrata/hicache, else ~/.cache/kvstrata/hicache); "
    "each storage namespace gets a folder under it.")

# PD disaggregation (kvstrata/transfer/disagg/), SGLang's SGLANG_DISAGGREGATION_* knobs.
KVSTRATA_DISAGG_BOOTSTRAP_TIMEOUT = _declare(
    "KVSTRATA_DISAGG_BOOTSTRAP_TIMEOUT", float, 300.0,
    "PD: seconds a request may stay bootstrapping (prefill waiting for the decode server's "
    "destination pages; decode resolving the prefill's endpoint) before it fails.")
KVSTRATA_DISAGG_UNREACHABLE_TIMEOUT = _declare(
    "KVSTRATA_DISAGG_UNREACHABLE_TIMEOUT", float, 5.0,
    "PD: seconds a decode server keeps retrying a prefill bootstrap server that refuses the "
    "connection or cannot be reached (one still starting) before the request fails; a "
    "bootstrap server that answers 'not ready' is retried up to the bootstrap timeout.")
KVSTRATA_DISAGG_WAITING_TIMEOUT = _declare(
    "KVSTRATA_DISAGG_WAITING_TIMEOUT", float, 300.0,
    "PD: seconds a decode receiver waits for its KV after sending its destination pages "
    "before it fails.")
KVSTRATA_DISAGG_HEARTBEAT_INTERVAL = _declare(
    "KVSTRATA_DISAGG_HEARTBEAT_INTERVAL", float, 5.0,
    "PD: seconds between the decode server's pings of each prefill server it receives from.")
KVSTRATA_DISAGG_HEARTBEAT_MAX_FAILURE = _declare(
    "KVSTRATA_DISAGG_HEARTBEAT_MAX_FAILURE", int, 2,
    "PD: unanswered pings in a row after which the peer is dead and its requests fail (the "
    "prefill side fails a decode peer silent for as long).")
KVSTRATA_DISAGG_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL = _declare(
    "KVSTRATA_DISAGG_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL", float, 120.0,
    "PD: the bootstrap server forgets room entries (room -> prefill dp rank) older than this "
    "many seconds, checked this often.")


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    try:
        return REGISTRY[name].get(environ)
    except KeyError:
        raise KeyError(f"{name} is not a registered kvstrata environment variable") from None


def snapshot(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every registered variable's current value (typed), e.g. for a pure resolution step."""
    return {name: var.get(environ) for name, var in REGISTRY.items()}


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """KVSTRATA_* variables that are set but not registered (likely typos); worth a warning."""
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.startswith(PREFIX) and k not in REGISTRY)
