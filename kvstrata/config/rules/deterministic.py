"""Step 8: deterministic inference (SGLang's --enable-deterministic-inference): which kernels it
pins, and where it is refused.

With it on, a request's output tokens and logprobs (greedy, or sampled with a `seed`: the
sampler draws from (seed, position), never from the batch) are bit-identical whatever else is
in its batch, however its prompt is chunked, and wherever its KV came from: computed in this
forward, a radix-cache hit, a HiCache L2 load-back or L3 restore, a PD prefill server, a
retraction's recompute or backup. Two sources of difference are removed:
  - a GEMM that picks its body (and so a row's summation order) by the number of rows: every
    linear layer runs one kvstrata GEMM at every row count (runner/cpu/packed_linear.py,
    PackedLinear._init_fixed);
  - attention that sums a cached prefix in another order than a fresh one (the prefill kernel's
    key blocks, SDPA, the decode kernel): by default every query token through the paged
    decode kernel (below); with KVSTRATA_CPU_DETERMINISTIC_BLOCKS=1 and a bf16 pool on the
    prefill kernel's AVX512-BF16 body (runner/attention/paged_decode.py fixed_order_pays:
    measured faster for prompts there, slower served: 0.962x of flag-off against 1.070x),
    every query token, prompt or decode, of a full-attention layer runs in
    the prefill kernel's order -- key blocks of 64 anchored at
    position 0, each score summed along the head in one order, one online-softmax merge per
    block, one rounding of the output, whatever the other rows of its tile, its cached prefix
    or the threads: prompts in the prefill kernel (its tiles share each key block's loads
    across query rows), decode rows as one-row prompts of it (runner/attention/csrc/
    decode_fixed.h; torch_native.py `fixed_order`). Otherwise (the default; fp32: decode rows
    lost 1.4-5x there), windowed layers (a row's keys begin W before it, not at position 0)
    and layers with softmax extras run every query through the paged decode kernel over its own keys
    (`deterministic`), with the extras inside
    it, per query row: Gemma 2's attention logit soft-capping (scores = cap * tanh(scores /
    cap) before the softmax) and gpt-oss's attention sinks (a learned logit per head in the
    denominator; runner/attention/window.py). KVSTRATA_CPU_PREFILL_ATTENTION=0 keeps every
    layer on that per-token path even with KVSTRATA_CPU_DETERMINISTIC_BLOCKS=1.
MoE models (runner/models/moe_decoder.py's Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5, and gpt-oss:
PINNED_MOE_FAMILIES): an expert's matmul runs over however many tokens the router sends it,
so its router, every expert's gate|up and down and its shared experts run on the same fixed
GEMM (one per expert weight, runner/cpu/fixed_experts.py), each token sums its k experts'
outputs in its own top-k order in float32 (moe.routed_sum, `ordered`), and a router's or
shared gate's sigmoid runs per row (moe.row_sigmoid: torch's elementwise sigmoid rounds an
element by its place in the flattened tensor -- vector body, scalar tail, thread split). Other
MoE models are refused by name; MoE models keep the default off (cost not measured).
Weights kept packed (--quantization gguf; GPTQ / AWQ / compressed-tensors checkpoints in GGUF
block rows): both GGUF kernels (runner/cpu/gguf_matmul.py) run one path for every row count,
so the packed segments are batch-invariant as they stand; a layer's float parts (an F32 / F16
segment of a fused q|k|v or gate|up, a float output head, a GPTQ lm_head) go on the fixed GEMM
(runner/quant/gguf_pinned.py). An FP8 checkpoint is dequantized at load: a float model. On by
default for --quantization gguf on AVX-512 CPUs (measured within 5%: PACKED_DEFAULT_*), opt-in
for the other quantized models (not measured).

MLA models (DeepSeek-V2 / V3, Kimi-K2, and V3.2 with its DSA indexer: PINNED_MLA_FAMILIES):
every query token, prompt or decode, attends in the same paged decode kernel over the pool's
latent rows (one KV head, keys and values alike; runner/attention/mla_fixed.py); V3.2's
indexer scores in one fixed summation order and its top-k by a stable sort (ties in position
order); the latent / query / output / indexer projections, kv_b_proj's absorbed halves (one
fixed GEMM per head) and every FFN (dense and MoE as above) on the fixed GEMM
(runner/models/deepseek_fixed.py). Not with --tp-size > 1 nor a NEXTN draft (refused by name
at load); the default stays off (cost not measured on a served workload).
Recurrent hybrids (Qwen3.5, Qwen3.5-MoE and Qwen3-Next's Gated DeltaNet; the Mamba2 layers of
Nemotron-H, Mamba2, Granite-4.0-H and Falcon-H1 (its attention and Mamba2 mixer side by side);
the MoE blocks of Qwen3-Next and Qwen3.5-MoE, Nemotron-H (relu^2 experts, latent projections,
the grouped sigmoid router with its correction bias) and Granite-4.0-H pinned as above:
PINNED_RECURRENT_ARCHITECTURES, runner/models/hybrid_fixed.py): a chunked scan (Mamba2's SSD,
Gated DeltaNet's chunk rule) sums in chunks that start where a prompt's chunk starts, and
decode advances the state token by token, so a state snapshot continued (a prefix hit), another
chunking or a retraction's recompute changed the bits. Under the flag every token, prompt or
decode, advances its request's state through the decode step's C kernel, one token at a time
and in order, in place on its state slot (rounded to the pool's dtype after every token, as
decode does): the state is a function of the tokens alone, and a snapshot is a copy of it
(runner/recurrent/fixed_scan.py). The causal conv sums its taps in one order for a prompt and a
decode row alike; the mixers' sigmoid, SiLU and softplus (beta, the decay, Mamba2's dt, the
gated norm's gate, the conv's SiLU), Falcon-H1's MLP SiLU and Qwen3.5's attention output gate
run position-free (runner/recurrent/pointwise.py, one scalar libm path per element); rotary cos
/ sin (Qwen3.5, Falcon-H1, a Granite with rope) from blocked tables and the rotation as
separately rounded products; the muP multipliers (Granite, Falcon-H1) are products by constants
(rounded alike anywhere). Every linear on the fixed GEMM, attention layers as the dense path.
Refused by name beside them: speculative decoding (verify entries run torch's per-token loop),
--tp-size > 1, --quantization and KVSTRATA_CPU_RECURRENT_STEP=0.
A random Qwen3.5 at hidden 512 (bf16, AMX CPU) measured prefill 0.64x and served 0.79x, its
decode faster (the fixed GEMM replaces plain F.linear) and its prefill slower by the fixed
GEMM off the AMX tiles, not by the per-token scan. On AVX-512 BF16 without AMX (2-vCPU EPYC,
2026-12-07, a box at load 35-60; CPU time, one thread) the flag is faster, not a cost: served
shape 1.29x (rounds 1.05-1.37x), batch-1 TPOT 0.72x, prefill of 384-token prompts 1.09x, and
at the test size Granite-4.0-H 1.31x, Falcon-H1 1.16x, Nemotron-H with MoE layers 1.19x
served -- the off arm runs torch's plain bf16 F.linear (oneDNN without AMX tiles), the flag
kvstrata's bf16 GEMM. The default stays off for them all the same: the AMX figure is a cost,
and off the flag no hybrid linear is packed yet, so the gain measures the packing rather than
the flag (docs/benchmarks.md "Deterministic inference on the recurrent hybrids").
Everything else in a forward runs per row on kvstrata's fused CPU ops (RMSNorm, rotary,
silu(gate) * up: runner/cpu/fused_ops.py) or per row by construction (sampling draws from
(seed, position)); torch's elementwise ops round an element by its place in the flattened
tensor (vector body, scalar tail, thread split), so KVSTRATA_CPU_FUSED_OPS=0 is refused too.
What it does not promise: equality across --tp-size values (each splits the GEMMs' and the
all-reduce's sums differently), across CPUs with other instruction sets (the GEMM's AVX2,
AVX-512 and AMX bodies differ), or with torch's own kernels on an accelerator (not built).
"""
from __future__ import annotations

from kvstrata.config.arg_choices import QUANTIZATION_AT_LOAD, QUANTIZATION_BUILT
from kvstrata.config.hf_quant import FLAG_ACCEPTS, PACKED_METHODS
from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, apply, change
from kvstrata.platform import Platform

RULE = "deterministic.kernels"
DEFAULT_RULE = "deterministic.cpu_default"
# Where it is on by default: the CPUs and dtypes whose cost was measured at most 5% (served,
# benchmarks/ab_deterministic.py: SmolLM2, 64 prompts, 32 concurrent, in 128, out 64; and
# batch-1 TPOT; on vs off alternated in one run). On a 2-vCPU AVX2 EPYC without AVX-512
# (2026-12-06): bf16 (what --dtype auto picks there) served 0.994x / 1.000x (median 0.997x),
# batch-1 TPOT 0.997x -- its bf16 GEMM already summed every row count in one order, and the
# paged decode kernel costs no more than the prefill kernel at 128-token prompts; fp32 served
# 0.91x (the fp32 GEMM replaces the GEMV and oneDNN, the prefill kernel's key blocks go), so
# fp32 keeps it opt-in. A long prompt's prefill pays 1.06x at 512 tokens and 1.15x at 2000
# (each token re-reads its keys; docs/benchmarks.md). On AVX-512 BF16 without AMX (2-vCPU EPYC,
# 2026-12-07) bf16 served 0.55x (TPOT 1.43x, batch 1 0.97x): opt-in there (the prefill
# kernel ran 2.2-3.5x SDPA there, which the flag gave up). Since then bf16 there runs every
# full-attention query in the prefill kernel's order (paged_decode.fixed_order_pays:
# attention alone, prompts 1.5-2.2x faster, decode rows 1.1-1.5x slower); the served shape
# offline at one thread in CPU time (ab_deterministic_offline.py, load 23-124) measured the
# flag within the box's +-10% noise in either order. Served at 2 threads on a quiet box
# (2-vCPU AMD EPYC, AVX-512 BF16, no AMX, load ~1, 2026-12-07, `ab_deterministic.py --dtypes
# bfloat16 --rounds 6 --settings off on on-per-token`): the per-token decode-kernel order
# served 1.070x of flag-off (1.007-1.097, faster in 6 of 6 rounds: the fixed bf16 GEMM
# replaces oneDNN at large row counts), TPOT 0.826x, batch-1 TPOT 1.034x (0.953-1.178); the
# prefill kernel's order 0.962x, TPOT 1.013x, batch-1 TPOT 1.078x. So the per-token order is
# the default (KVSTRATA_CPU_DETERMINISTIC_BLOCKS=0) and the flag is on by default at bf16 on
# AVX-512 BF16 without AMX (BF16_DEFAULT_*). On AMX (2-vCPU Sapphire Rapids
# VM, 2026-12-07, the fixed layers on the tiles at every row count): served 0.81-0.91x (median
# 0.89x), TPOT 1.13x, batch 1 1.08x: opt-in there too.
# config.json model_types whose routed experts run on the fixed GEMM (runner/models/
# moe_decoder.py through runner/cpu/fixed_experts.py); gpt-oss's are pinned too, but its
# attention sinks keep it refused (softmax_extras)
PINNED_MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss")
# config.json model_types of MLA models (runner/models/deepseek.py) whose attention, indexer,
# projections and experts deterministic inference pins (runner/models/deepseek_fixed.py)
PINNED_MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")
# KVSTRATA_* switches that turn off a kernel deterministic inference runs (kvstrata/envs.py)
ABLATIONS = ("KVSTRATA_CPU_PAGED_DECODE", "KVSTRATA_CPU_PACKED_LINEAR", "KVSTRATA_CPU_FUSED_OPS")
# config.json architectures of the recurrent hybrids it pins (the classes runner/models/
# hybrid_fixed.py pins): every token through the recurrent C step (runner/recurrent/
# fixed_scan.py); the model_types whose experts it pins (Qwen3-Next's and Qwen3.5-MoE's,
# Nemotron-H's MoE blocks, Granite-4.0-H's top-k MoE: the router, each expert and the
# shared MLP on the fixed GEMM, the combine in each token's top-k order)
PINNED_RECURRENT_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM",
                                  "NemotronHForCausalLM", "Mamba2ForCausalLM",
                                  "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM",
                                  "Qwen3_5MoeForCausalLM")
PINNED_RECURRENT_MOE = ("qwen3_next", "qwen3_5_moe_text", "nemotron_h", "granitemoehybrid")
# the ablation of the C step those models' pinned scan runs for every token
RECURRENT_ABLATION = "KVSTRATA_CPU_RECURRENT_STEP"
RECURRENT_KERNEL = ("the recurrent layers' one-token C step for every token, prompt or "
                    "decode, in order, in place on the state slot (runner/recurrent/"
                    "fixed_scan.py); the causal conv's taps in one order; sigmoid / SiLU / "
                    "softplus position-free (runner/recurrent/pointwise.py)")
RECURRENT_WHY = ("the chunked scans (Mamba2's SSD, Gated DeltaNet's chunk rule) sum in chunks "
                 "that start where a prompt's chunk starts and decode steps token by token, so "
                 "a state snapshot continued (a prefix hit), another chunking or a recompute "
                 "changed the bits; one recurrence per token makes the state a function of "
                 "the tokens alone")
DEFAULT_NEEDS = frozenset({"avx2", "fma", "f16c"})
DEFAULT_LACKS = frozenset({"avx512f"})
DEFAULT_DTYPES = ("bfloat16",)
DEFAULT_WHY = ("on by default on a CPU with AVX2 and without AVX-512 at bfloat16: measured "
               "free there (served 0.997x, batch-1 TPOT 0.997x, benchmarks/ab_deterministic.py, "
               "2026-12-06); --disable-deterministic-inference turns it off")
# A float model at bf16 on AVX-512 BF16 without AMX (measured above, 2026-12-07)
BF16_DEFAULT_NEEDS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16"})
BF16_DEFAULT_LACKS = frozenset({"amx_bf16"})
BF16_DEFAULT_WHY = ("on by default on a CPU with AVX-512 BF16 and without AMX at bfloat16: "
                    "measured within 5% there (served 1.070x of flag-off, TPOT 0.826x, "
                    "batch-1 TPOT 1.034x, median of 6 rounds, benchmarks/ab_deterministic.py, "
                    "2026-12-07); --disable-deterministic-inference turns it off")
# GGUF weights kept packed (--quantization gguf) on a CPU with AVX-512: the flag leaves their
# GGUF kernels as they are (one path for every row count already) and moves only the float
# parts (none in SmolLM2 Q4_1's file) and the attention of prompt tokens (the paged decode
# kernel over each query's keys). Measured on a 2-vCPU AVX-512 + AMX box, 2026-12-07
# (benchmarks/ab_deterministic_offline.py: SmolLM2 Q4_1 kept packed, both engines in one
# process at one thread, CPU time, on / off alternated; 32 prompts of 128 tokens, 32 at once,
# 32 out; a busy box, load 20-100): float32 (--dtype auto's choice for packed weights) over 6
# rounds in two runs served 0.994x / 1.009x (0.961-1.057), batch-1 TPOT 0.989x / 1.045x
# (0.93-1.07); bfloat16 over 2 rounds 0.979x and 0.982x: within the 5%, so on by
# default there. An AVX2 CPU without AVX-512 is not measured packed: opt-in there.
PACKED_DEFAULT_NEEDS = frozenset({"avx2", "fma", "f16c", "avx512f"})
PACKED_DEFAULT_DTYPES = ("float32", "bfloat16")
PACKED_DEFAULT_WHY = ("on by default for GGUF weights kept packed (--quantization gguf) on a "
                      "CPU with AVX-512: measured within 5% there (SmolLM2 Q4_1, float32 "
                      "served shape 0.994x, batch-1 TPOT 0.989x; bfloat16 0.979x / 0.982x; "
                      "benchmarks/ab_deterministic_offline.py, 2026-12-07: the GGUF kernels "
                      "are batch-invariant as they stand, only prompt attention moves); "
                      "--disable-deterministic-inference turns it off")
LINEAR_KERNEL = ("kvstrata's bf16 / fp32 GEMM at every row count (runner/cpu/packed_linear.py "
                 "_init_fixed)")
LINEAR_WHY = ("oneDNN's linear, the fp32 GEMV (1-16 rows) and the AMX / oneDNN split above 64 "
              "rows each sum a row in their own order, so a row's bits depended on how many "
              "rows shared the call; kvstrata's GEMM tiles sum each output over k in one order "
              "for any row count")
# --quantization values (and a draft's) the flag takes, every one built: w8a8_int8's own
# int8 GEMM quantises each row on its own (per-token scale), sums in int32 (exact, so any order
# gives the same sum) and scales each output by its row's and column's scale alone; the load
# refuses a CPU where a layer would fall to fbgemm or oneDNN (runner/quant/w8a8.py); an MoE's
# float router and a DeepSeek model's float parts (indexer, absorbed heads) go on the fixed
# GEMM beside it (w8a8.quantize_experts, runner/models/deepseek_w8a8.py). gguf and
# the HF integer schemes (gptq / awq / compressed-tensors and their *_marlin names) keep
# their weights in GGUF blocks: both GGUF kernels (runner/cpu/gguf_matmul.py) run one path
# for every row count, and their float parts (F32 / F16 segments of a fused layer, a float
# output head, a GPTQ checkpoint's lm_head) go on the fixed GEMM (runner/quant/
# gguf_pinned.py). fp8 is dequantized at load: a float model's fixed GEMM.
PINNED_QUANTIZATIONS = QUANTIZATION_BUILT
INT8_LINEAR_KERNEL = ("kvstrata's int8 GEMM at every row count (runner/cpu/int8_linear.py; "
                      "int32 sums are exact, each row quantised alone)")
PACKED_LINEAR_KERNEL = ("kvstrata's GGUF GEMMs for the packed weights (runner/cpu/"
                        "gguf_matmul.py: one path and summation order for every row count), "
                        "its bf16 / fp32 GEMM at every row count for their float parts "
                        "(runner/quant/gguf_pinned.py)")
PACKED_QUANTIZATIONS = ("gguf", *(name for method in PACKED_METHODS
                                  for name in FLAG_ACCEPTS[method]))
ATTENTION_KERNEL = ("bf16 on AVX512-BF16: the prefill kernel's order for every query token "
                    "of a full-attention layer (prompts in the prefill kernel, decode rows as "
                    "one-row prompts of it: runner/attention/csrc/decode_fixed.h); else, and "
                    "for windowed layers and sinks / soft-capping: the paged decode kernel for "
                    "every query token (runner/attention/paged_decode.py)")
MLA_ATTENTION_KERNEL = ("the paged decode kernel for every query token over the MLA pool's "
                        "latent rows, one KV head of keys and values alike "
                        "(runner/attention/mla_fixed.py)")
DSA_ATTENTION_KERNEL = (MLA_ATTENTION_KERNEL + ", over each query's top-k slots; the DSA "
                        "indexer's scores in one summation order and its top-k by a stable "
                        "sort")
MLA_LINEAR_KERNEL = (LINEAR_KERNEL + "; MLA's projections, kv_b_proj's absorbed halves (one "
                     "GEMM per head) and the DeepSeek MoE router and experts too "
                     "(runner/models/deepseek_fixed.py)")
MLA_ATTENTION_WHY = ("the dense MLA path scored a prompt with one matmul over its gathered "
                     "keys and decode tokens with one padded bmm, and DSA's indexer scored "
                     "keys with a matmul and broke exact score ties by torch.topk's "
                     "algorithm, each following the group's shape; here every query's "
                     "scores, softmax and weighted sum run in its own key order in fp32, "
                     "the indexer's sums in one order, ties in position order")
ATTENTION_WHY = ("the prefill kernel (key blocks of a prompt), SDPA (fresh keys) and the decode "
                 "kernel (keys read from the pool) sum a query's keys in different orders, so a "
                 "cached or transferred prefix changed the bits; one order per query row -- "
                 "key blocks anchored at position 0 -- makes a row's bits a function of its "
                 "query, keys and values, whatever the other rows of its call")


def deterministic_inference(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                            env: dict) -> list[Resolution]:
    if args.enable_deterministic_inference and args.disable_deterministic_inference:
        raise ValueError("--enable-deterministic-inference and "
                         "--disable-deterministic-inference contradict each other")
    out: list[Resolution] = []
    # Kernel ablations that switch off what it runs: the default stays off; the flag refuses.
    ablations = [name for name in ABLATIONS if not env.get(name, True)]
    why = _default_why(args, platform, model_info)
    if why is not None and not ablations:
        out = change(args, "enable_deterministic_inference", True, DEFAULT_RULE, why)
        args = apply(args, out)
    if not args.enable_deterministic_inference:
        return out
    device = args.device or platform.device_type
    if device != "cpu":
        raise ValueError(f"--enable-deterministic-inference: not implemented yet on {device} "
                         f"(kvstrata's batch-invariant kernels are its CPU kernels)")
    if not _model_built(model_info):
        kind = "recurrent" if model_info.has_recurrent_state else model_info.kv_pool_kind
        if model_info.routed_experts and kind in ("mha", "swa"):
            raise ValueError(f"--enable-deterministic-inference: not implemented yet for a "
                             f"MoE model of type {model_info.routed_experts} (its experts' "
                             f"matmuls run on however many tokens the router sends each, in "
                             f"torch's kernels); built for "
                             f"{', '.join(PINNED_MOE_FAMILIES)}")
        if kind == "mla":
            raise ValueError(f"--enable-deterministic-inference: not implemented yet for an "
                             f"MLA model of type {model_info.routed_experts or 'unknown'} "
                             f"(built for {', '.join(PINNED_MLA_FAMILIES)})")
        if kind == "recurrent":
            raise ValueError(f"--enable-deterministic-inference: not implemented yet for a "
                             f"recurrent model ({_recurrent_name(model_info)}; built for "
                             f"{', '.join(PINNED_RECURRENT_ARCHITECTURES)})")
        raise ValueError(f"--enable-deterministic-inference: not implemented yet for a "
                         f"{kind} model; the llama-family decoder has it, sliding windows and "
                         f"their own SWA pool included, the DeepSeek MLA / DSA models and "
                         f"the recurrent hybrids")
    recurrent = model_info is not None and model_info.has_recurrent_state
    if recurrent:
        _refuse_recurrent_combinations(args, env)
    for flag_name, value in _quantizations(args):
        if value not in PINNED_QUANTIZATIONS:
            raise ValueError(f"--enable-deterministic-inference: not implemented yet with "
                             f"{flag_name} {value}")
    if ablations:
        switched = " and ".join(f"{name}=0" for name in ablations)
        raise ValueError(f"--enable-deterministic-inference runs kernels that {switched} "
                         f"turns off: unset it, or pass --disable-deterministic-inference")
    linear = _linear_kernel(args, model_info)
    attention, attention_why = ATTENTION_KERNEL, ATTENTION_WHY
    if model_info is not None and model_info.kv_pool_kind == "mla":
        linear, attention_why = MLA_LINEAR_KERNEL, MLA_ATTENTION_WHY
        attention = DSA_ATTENTION_KERNEL if model_info.uses_dsa else MLA_ATTENTION_KERNEL
    out = (out + change(args, "deterministic_linear_kernel", linear, RULE, LINEAR_WHY)
           + change(args, "deterministic_attention_kernel", attention, RULE, attention_why))
    if recurrent:
        out += change(args, "deterministic_recurrent_kernel", RECURRENT_KERNEL, RULE,
                      RECURRENT_WHY)
    return out


def _recurrent_name(model_info: ModelInfo) -> str:
    if model_info.architecture in PINNED_RECURRENT_ARCHITECTURES:  # its MoE variant
        return f"{model_info.architecture} with {model_info.routed_experts} MoE layers"
    return model_info.architecture or "architecture unknown"


def _refuse_recurrent_combinations(args: ResolvedArgs, env: dict) -> None:
    """What the recurrent hybrids' pinned path does not build (refused by name)."""
    if args.speculative_algorithm:
        raise ValueError(f"--enable-deterministic-inference with --speculative-algorithm "
                         f"{args.speculative_algorithm} on a recurrent model: not implemented "
                         f"yet (its verify entries' states run torch's per-token loop)")
    if args.tp_size > 1:
        raise ValueError(f"--enable-deterministic-inference with --tp-size {args.tp_size} on "
                         f"a recurrent model: not implemented yet")
    if args.quantization is not None:
        raise ValueError(f"--enable-deterministic-inference with --quantization "
                         f"{args.quantization} on a recurrent model: not implemented yet")
    if not env.get(RECURRENT_ABLATION, True):
        raise ValueError(f"--enable-deterministic-inference runs the kernel that "
                         f"{RECURRENT_ABLATION}=0 turns off: unset it, or pass "
                         f"--disable-deterministic-inference")


def _linear_kernel(args: ResolvedArgs, model_info: ModelInfo | None) -> str:
    """What the target's linears run under the flag (a quantized draft's are its own)."""
    if args.quantization in QUANTIZATION_AT_LOAD:
        return INT8_LINEAR_KERNEL
    if args.quantization in PACKED_QUANTIZATIONS or (
            model_info is not None and model_info.quant_method in PACKED_METHODS):
        return PACKED_LINEAR_KERNEL
    return LINEAR_KERNEL  # float, or an fp8 checkpoint dequantized at load


def _default_why(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None
                 ) -> str | None:
    """Why it is on by default here (None: off): neither flag given, and a CPU, dtype and
    model where it was measured free (above) -- a float model (DEFAULT_*, BF16_DEFAULT_*), or
    GGUF weights kept packed (PACKED_DEFAULT_*; no quantized draft). Other quantized models
    take the flag (every built --quantization and checkpoint scheme) but their cost is not measured; nor a
    model with softmax extras (Gemma 2's soft-cap: its cost with the flag was not measured,
    and off it runs window.py's torch math), nor a recurrent hybrid (a Qwen3.5 at hidden 512
    measured prefill 0.64x, served 0.79x on an AMX CPU; faster with the flag without AMX,
    1.29x served, where its off arm runs unpacked F.linear)."""
    if (args.enable_deterministic_inference or args.disable_deterministic_inference
            or (args.device or platform.device_type) != "cpu" or not _model_built(model_info)
            or (model_info is not None and (model_info.quant_method or model_info.softmax_extras
                                            # MoE: built, but its cost (one GEMM call per
                                            # expert weight) is not measured
                                            or model_info.routed_experts
                                            # MLA: built, but its cost is not measured
                                            or model_info.kv_pool_kind == "mla"
                                            # recurrent: prefill measured 0.64x
                                            # (docs/benchmarks.md)
                                            or model_info.has_recurrent_state))):
        return None
    flags = set(platform.cpu_flags)
    quantized = _quantizations(args)
    if not quantized and args.dtype in DEFAULT_DTYPES:
        if DEFAULT_NEEDS <= flags and not DEFAULT_LACKS & flags:
            return DEFAULT_WHY
        if BF16_DEFAULT_NEEDS <= flags and not BF16_DEFAULT_LACKS & flags:
            return BF16_DEFAULT_WHY
    if (quantized == [("--quantization", "gguf")] and args.dtype in PACKED_DEFAULT_DTYPES
            and PACKED_DEFAULT_NEEDS <= flags):
        return PACKED_DEFAULT_WHY
    return None


def _model_built(model_info: ModelInfo | None) -> bool:
    """A plain MHA model without recurrent state, dense or with experts of a family the fixed
    GEMM pins, its softmax extras (sinks, soft-capping) in the decode kernel; a DeepSeek MLA
    model, DSA or not; or a recurrent hybrid hybrid_fixed.py pins (None, unknown: assumed a
    plain model, as everywhere in resolution)."""
    if model_info is None:
        return True
    if model_info.has_recurrent_state:  # the hybrids runner/models/hybrid_fixed.py pins
        return (model_info.architecture in PINNED_RECURRENT_ARCHITECTURES
                and model_info.routed_experts in ("", *PINNED_RECURRENT_MOE))
    if model_info.kv_pool_kind == "mla":
        return model_info.routed_experts in PINNED_MLA_FAMILIES
    # "swa" (hybrid SWA memory, rules/swa.py): the same decode kernel reads each layer's own
    # pool, key ranges cut to the window (tests/correctness/test_swa_memory.py)
    return (model_info.kv_pool_kind in ("mha", "swa") and not model_info.uses_dsa
            and model_info.routed_experts in ("", *PINNED_MOE_FAMILIES))


def _quantizations(args: ResolvedArgs) -> list[tuple[str, str]]:
    """The quantized models asked for (the target's, a draft's): the flag takes the
    PINNED_QUANTIZATIONS; the default is measured without them."""
    draft = args.speculative_draft_model_quantization
    return ([("--quantization", args.quantization)] if args.quantization is not None else []) + (
        [("--speculative-draft-model-quantization", draft)]
        if draft not in (None, "unquant") else [])
