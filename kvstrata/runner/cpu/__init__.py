"""CPU kernels and the linear layers built on them (C extensions in csrc/, the ISA picked at
run time). The lowest runner sub-layer: it imports no other runner package.

  isa.py            KVSTRATA_CPU_ISA's cap (pinned per forward) and the AVX2 test
  fused_ops.py      fused row ops (RMSNorm, silu*up, rope) of `_cpu_ops`
  packed_linear.py  fp32 / bf16 linears (oneDNN-prepacked, or kvstrata's bf16 GEMM `_bf16_ops`)
  f32_gemv.py       fp32 linears for decode rows (kvstrata's GEMV and fp32 GEMM)
  fixed_linear.py   deterministic inference's linears: one GEMM body for every row count
  fixed_experts.py  MoE blocks' router, experts, shared experts as packed linears: on the
                    fixed GEMM (deterministic inference) or packed for serving (DeepSeek's)
  int8_linear.py    w8a8 int8 linears (kvstrata's int8 GEMM `_int8_ops`, or oneDNN's)
  gguf_matmul.py    x @ W.T with W in GGUF quantized blocks (--quantization gguf): kvstrata's
                    GEMM `_gguf_ops` (dequantized in registers, batch-invariant; AVX2 or a
                    portable C body with the same bits)
  dtype_probe.py    --dtype auto where no table row covers the CPU: time bf16 vs fp32 once
  csrc/             the C sources of `_cpu_ops`, `_int8_ops`, `_bf16_ops`, `_gguf_ops` (setup.py;
                    gguf_ops.c + gguf_blocks_{avx2,scalar}.h: the GGUF block formats)
"""
