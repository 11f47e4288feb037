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
    key blocks, SDPA, the decode kernel): every query token, prompt or decode, runs the paged
    decode kernel over its own keys (runner/attention/torch_native.py, `deterministic`).
Everything else in a forward is already per row (norms, rotary, activations, sampling).
What it does not promise: equality across --tp-size values (each splits the GEMMs' and the
all-reduce's sums differently), across CPUs with other instruction sets (the GEMM's AVX2,
AVX-512 and AMX bodies differ), or with torch's own kernels on an accelerator (not built).
"""
from __future__ import annotations

from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, change
from kvstrata.platform import Platform

RULE = "deterministic.kernels"
LINEAR_KERNEL = ("kvstrata's bf16 / fp32 GEMM at every row count (runner/cpu/packed_linear.py "
                 "_init_fixed)")
LINEAR_WHY = ("oneDNN's linear, the fp32 GEMV (1-16 rows) and the AMX / oneDNN split above 64 "
              "rows each sum a row in their own order, so a row's bits depended on how many "
              "rows shared the call; kvstrata's GEMM tiles sum each output over k in one order "
              "for any row count")
ATTENTION_KERNEL = "the paged decode kernel for every query token (runner/attention/paged_decode.py)"
ATTENTION_WHY = ("the prefill kernel (key blocks of a prompt), SDPA (fresh keys) and the decode "
                 "kernel (keys read from the pool) sum a query's keys in different orders, so a "
                 "cached or transferred prefix changed the bits; the decode kernel scores, "
                 "normalises and sums each query's own keys in position order, whatever the "
                 "other queries")


def deterministic_inference(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                            env: dict) -> list[Resolution]:
    if args.enable_deterministic_inference and args.disable_deterministic_inference:
        raise ValueError("--enable-deterministic-inference and "
                         "--disable-deterministic-inference contradict each other")
    if not args.enable_deterministic_inference:
        return []
    device = args.device or platform.device_type
    if device != "cpu":
        raise ValueError(f"--enable-deterministic-inference: not implemented yet on {device} "
                         f"(kvstrata's batch-invariant kernels are its CPU kernels)")
    if model_info is not None and (model_info.kv_pool_kind != "mha" or model_info.uses_dsa):
        raise ValueError(f"--enable-deterministic-inference: not implemented yet for a "
                         f"{model_info.kv_pool_kind} KV pool (MLA / DSA, sliding-window and "
                         f"recurrent models); the llama-family decoder has it")
    if args.quantization is not None:
        raise ValueError(f"--enable-deterministic-inference: not implemented yet with "
                         f"--quantization {args.quantization}")
    return (change(args, "deterministic_linear_kernel", LINEAR_KERNEL, RULE, LINEAR_WHY)
            + change(args, "deterministic_attention_kernel", ATTENTION_KERNEL, RULE,
                     ATTENTION_WHY))
