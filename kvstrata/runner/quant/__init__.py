"""--quantization on load.

  w8a8.py              w8a8_int8: int8 weights per channel, int8 activations per token
  smoothing.py         SmoothQuant activation smoothing, calibrated at load
  calibration_text.py  the fixed calibration passage
  mxfp4.py             MXFP4 checkpoint weights (gpt-oss experts), dequantized at load
  packed_rows.py       a weight kept in GGUF blocks (PackedRows: rows, act-order permutation)
  gguf_linear.py       gguf: GGUF weights kept quantized as linear layers (and the embedding)
"""
