"""ServerArgs' vocabulary: `opt` (a dataclass field carrying its CLI help, choices and group)
and the choice tuples of its flags (SGLang's names; which of them are built is said beside
each). config/server_args.py re-exports every name here.
"""
from __future__ import annotations

from dataclasses import field
from typing import Any

from kvstrata.config.kv_plan import HOST_LAYOUTS, IO_BACKENDS


def opt(default: Any, help: str, *, choices: tuple | None = None, group: str = "engine",
        cli: bool = True) -> Any:
    """A dataclass field carrying its CLI help/choices/group, so argparse is derived from it."""
    return field(default=default, metadata={"help": help, "choices": choices, "group": group,
                                            "cli": cli})


DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cuda", "npu", "xpu", "mps", "cpu")
PLATFORMS = ("cuda", "hip", "npu", "xpu", "mps", "cpu")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
SCHEDULE_POLICIES = ("fcfs", "lpm", "lof")
RADIX_EVICTION_POLICIES = ("lru", "lfu")
HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
HICACHE_IO_BACKENDS = IO_BACKENDS  # the layout x IO table lives with the KV plan
HICACHE_MEM_LAYOUTS = HOST_LAYOUTS
HICACHE_HOST_MEMORY_MODES = ("cache", "buffer_only")
HICACHE_STORAGE_BACKENDS = ("file", "mooncake", "memory")  # memory: in-process, for tests
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
DISAGG_MODES = ("null", "prefill", "decode")
DISAGG_TRANSFER_BACKENDS = ("tcp", "mooncake", "fake")
RETRACTION_BACKUPS = ("cpu_tensor", "host_pool")
MAMBA_SSM_DTYPES = ("bfloat16", "float32")
MAMBA_RADIX_CACHE_STRATEGIES = ("auto", "no_buffer", "extra_buffer")
# SGLang's --speculative-algorithm names (NEXTN resolves to EAGLE with the checkpoint's own
# MTP layer); which ones are built is config/rules/speculative.py's business.
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
NGRAM_MATCH_TYPES = ("BFS", "PROB")
# SGLang's --grammar-backend names; only llguidance (no torch or triton needed) is built.
GRAMMAR_BACKENDS = ("xgrammar", "outlines", "llguidance", "none")
# SGLang's --tool-call-parser names that are built, then vLLM's names for the same formats
# (entrypoints/tool_calls/__init__.py holds the formats; a test keeps the two lists equal).
TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes", "llama3", "mistral", "deepseekv3", "kimi_k2",
                     "pythonic", "qwen3_coder", "glm45", "glm", "glm47", "llama3_json",
                     "deepseek_v3", "llama4_pythonic", "qwen3_xml")
# SGLang's --reasoning-parser names that are built (entrypoints/reasoning.py FORMATS).
REASONING_PARSERS = ("deepseek-r1", "deepseek-v3", "qwen3", "qwen3-thinking", "glm45", "kimi",
                     "kimi_k2", "step3", "minimax", "mistral")
# SGLang's --quantization names. Built: w8a8_int8 (quantizes a float checkpoint at load,
# CPU), gguf (a GGUF file's weights kept in their quantized blocks), and the names of schemes
# a checkpoint is saved in (config/hf_quant.py: the checkpoint's quantization_config decides,
# the flag may only agree with it; the *_marlin names are GPU kernels of the same weights).
# The others are refused as "not implemented yet" (config/resolve.py UNIMPLEMENTED) rather
# than unknown.
QUANTIZATION_AT_LOAD = ("w8a8_int8",)
QUANTIZATION_FROM_CHECKPOINT = ("gptq", "gptq_marlin", "awq", "awq_marlin", "marlin",
                                "compressed-tensors", "fp8")
QUANTIZATION_BUILT = QUANTIZATION_AT_LOAD + ("gguf",) + QUANTIZATION_FROM_CHECKPOINT
QUANTIZATIONS = ("awq", "fp8", "gptq", "marlin", "gptq_marlin", "awq_marlin", "bitsandbytes",
                 "gguf", "modelopt", "modelopt_fp4", "w8a8_int8", "w8a8_fp8", "moe_wna16",
                 "qoq", "w4afp8", "mxfp4", "compressed-tensors")
# --load-format: auto (safetensors / .bin for a directory; a GGUF file as
# config/rules/gguf_weights.py decides), SGLang's gguf (weights kept quantized), and
# gguf_dequantize (kvstrata's: every GGUF weight dequantized to float at load).
LOAD_FORMATS = ("auto", "gguf", "gguf_dequantize")
