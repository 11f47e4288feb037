"""Step 0 (before the platform defaults, whose --dtype auto reads --quantization): how a GGUF
file's weights load.

- `--quantization gguf` / `--load-format gguf` (SGLang's and vLLM's spellings): the quantized
  weights stay in their blocks (runner/quant/gguf_linear.py); --load-format gguf sets
  --quantization gguf (rule gguf_weights.kept).
- `--load-format gguf_dequantize`: every weight dequantized to float at load (then served in
  --dtype, or re-quantized by --quantization w8a8_int8, which always reads the float path).
- `--load-format auto` on a GGUF file: KEPT_QUANTIZED_BY_DEFAULT says which of the two. It is
  False for now: the packed kernels (runner/cpu/gguf_matmul.py) have landed, with 8-bit
  activation blocks and integer dot products since issue 64 (1.13-1.30x the float-activation
  kernel served at batch 1), but SmolLM2-135M Q4_1 served kept quantized on a 2-vCPU AVX2 box
  still ran 0.56-0.63x the bf16 model dequantized at load at batch 1 and 0.51x at batch 32
  (one thread, same run, 2026-12-07: docs/benchmarks.md); kept quantized becomes the default
  once it wins at batch 1 with its perplexity ratio <= 1.01 (0.995 measured).
Refused by name: either spelling on a path that is not a GGUF file; --quantization gguf with
--load-format gguf_dequantize; weights kept quantized with --tp-size > 1 (a rank's share of a
row-parallel weight would cut the GGUF blocks).
"""
from __future__ import annotations

from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, change
from kvstrata.platform import Platform

RULE = "gguf_weights.kept"
KEPT_QUANTIZED_BY_DEFAULT = False


def is_gguf_model(model_path: str) -> bool:
    """A .gguf file, or a known short name of one (config/model_source.py)."""
    from kvstrata.config.model_source import resolve_model_path  # noqa: PLC0415

    try:
        return resolve_model_path(model_path).kind == "gguf"
    except ValueError:
        return model_path.lower().endswith(".gguf")


def gguf_weights(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                 env: dict) -> list[Resolution]:
    fmt, quant = args.load_format, args.quantization
    asks = [f"--load-format {fmt}"] if fmt != "auto" else []
    asks += ["--quantization gguf"] if quant == "gguf" else []
    gguf = is_gguf_model(args.model_path)
    if asks and not gguf:
        raise ValueError(f"{' and '.join(asks)}: --model-path {args.model_path!r} is not a "
                         f"GGUF file")
    if quant == "gguf" and fmt == "gguf_dequantize":
        raise ValueError("--quantization gguf (weights kept quantized) and --load-format "
                         "gguf_dequantize (weights dequantized at load) contradict each other")
    out: list[Resolution] = []
    if quant is None and gguf and (fmt == "gguf" or (fmt == "auto"
                                                     and KEPT_QUANTIZED_BY_DEFAULT)):
        why = ("--load-format gguf" if fmt == "gguf" else "a GGUF file with --load-format auto")
        out = change(args, "quantization", "gguf", RULE,
                     f"{why}: its quantized weights stay in their blocks and are multiplied "
                     f"packed (--load-format gguf_dequantize loads them as float)")
        quant = "gguf"
    if quant == "gguf" and args.tp_size > 1:
        raise ValueError(f"--tp-size {args.tp_size} with GGUF weights kept quantized "
                         f"(--quantization gguf) is not implemented yet: a rank's share of a "
                         f"row-parallel weight would cut its quantized blocks; pass "
                         f"--load-format gguf_dequantize (or --tp-size 1)")
    return out


__all__ = ["KEPT_QUANTIZED_BY_DEFAULT", "RULE", "gguf_weights", "is_gguf_model"]
