"""Resolution rules, one module per family, in pipeline order:
GGUF weights (kept quantized or dequantized) -> platform defaults -> HiCache (mode, layout/IO, storage/layout, ratio) -> decode-retraction
backup -> DSA gates -> speculative decoding -> deterministic inference. Each step is a pure function of (args, platform, model_info, env) that
returns the Resolutions it wants applied (or raises ValueError naming the flags)."""
