"""--quantization on load, and the weights of quantized checkpoints.

  w8a8.py              w8a8_int8: int8 weights per channel, int8 activations per token
  hybrid_w8a8.py       w8a8_int8 on the recurrent hybrids' projections (no smoothing)
  smoothing.py         SmoothQuant activation smoothing, calibrated at load
  calibration_text.py  the fixed calibration passage
  mxfp4.py             MXFP4 checkpoint weights (gpt-oss experts), dequantized at load
  packed_rows.py       PackedRows: a weight kept in GGUF block rows (+ act-order permutation)
  gguf_linear.py       gguf: GGUF weights kept quantized as linear layers (and the embedding)
  gguf_pinned.py       deterministic inference over packed layers: float parts on the fixed GEMM
  hf_int.py            GPTQ / AWQ / compressed-tensors int4 / int8 -> GGUF Q4_1 / Q8_0 rows
  hf_checkpoint.py     a quantized HF checkpoint's per-linear parts -> one weight (PackedRows,
                       or FP8 dequantized) as the safetensors files are read
"""
