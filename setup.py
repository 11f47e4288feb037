# Metadata lives in pyproject.toml; this file only declares the C extensions: the CPU row copy
# behind HiCache's `kernel` IO backend (kvstrata/kv/rowcopy.py) and the paged decode attention
# of the CPU attention backend (kvstrata/runner/attention/paged_decode.py), and the CPU row ops
# and GEMMs of kvstrata/runner/csrc/.
import os

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstrata.kv._rowcopy", ["kvstrata/kv/csrc/rowcopy.c"],
                             extra_compile_args=["-O3"]),
                   Extension("kvstrata.runner.attention._paged_decode",
                             ["kvstrata/runner/attention/csrc/paged_decode.c"],
                             depends=["kvstrata/runner/attention/csrc/paged_decode_isa.h",
                                      "kvstrata/runner/attention/csrc/paged_decode_head64.h",
                                      "kvstrata/runner/attention/csrc/paged_decode_head64_bf16.h",
                                      "kvstrata/runner/attention/csrc/paged_decode_head64_avx2.h",
                                      "kvstrata/runner/attention/csrc/prefill_attention.h",
                                      "kvstrata/runner/attention/csrc/prefill_attention_bf16.h",
                                      "kvstrata/runner/csrc/cpu_vec.h"],
                             # OpenMP: at run time libgomp.so.1 resolves to torch's copy
                             # (already loaded, same soname), so the kernel shares its team.
                             extra_compile_args=["-O3", "-fopenmp"],
                             extra_link_args=["-fopenmp"]),
                   Extension("kvstrata.runner._cpu_ops", ["kvstrata/runner/csrc/cpu_ops.c"],
                             depends=["kvstrata/runner/csrc/cpu_vec.h",
                                      "kvstrata/runner/csrc/cpu_rows.h",
                                      "kvstrata/runner/csrc/shm_allreduce.h",
                                      "kvstrata/runner/csrc/argmax_rows.h",
                                      "kvstrata/runner/csrc/rms_f32_rows.h",
                                      "kvstrata/runner/csrc/f32_gemv.h"],
                             # no implicit FMA: rope's products and sum round as torch's do
                             extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
                             extra_link_args=["-fopenmp"]),
                   Extension("kvstrata.runner._int8_ops", ["kvstrata/runner/csrc/int8_ops.c"],
                             depends=["kvstrata/runner/csrc/cpu_vec.h",
                                      "kvstrata/runner/csrc/cpu_rows.h",
                                      "kvstrata/runner/csrc/int8_gemm.h",
                                      "kvstrata/runner/csrc/int8_gemm_avx2.h",
                                      "kvstrata/runner/csrc/int8_gemm_amx.h",
                                      "kvstrata/runner/csrc/amx_tiles.h",
                                      "kvstrata/runner/csrc/amx_item.h",
                                      "kvstrata/runner/csrc/amx_item_body.h",
                                      "kvstrata/runner/csrc/gemm_panels.h",
                                      "kvstrata/runner/csrc/side_rows.h"],
                             # one rounding per product: the scalar and AVX-512 rows agree
                             extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
                             extra_link_args=["-fopenmp"]),
                   Extension("kvstrata.runner._bf16_ops", ["kvstrata/runner/csrc/bf16_gemm.c"],
                             depends=["kvstrata/runner/csrc/bf16_gemm_avx2.h",
                                      "kvstrata/runner/csrc/bf16_gemm_amx.h",
                                      "kvstrata/runner/csrc/amx_tiles.h",
                                      "kvstrata/runner/csrc/amx_item.h",
                                      "kvstrata/runner/csrc/amx_item_body.h",
                                      "kvstrata/runner/csrc/cpu_vec.h",
                                      "kvstrata/runner/csrc/cpu_rows.h",
                                      "kvstrata/runner/csrc/gemm_panels.h",
                                      "kvstrata/runner/csrc/side_rows.h"],
                             extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
                             extra_link_args=["-fopenmp"])],
      # the extensions compile side by side (~13 -> ~7 s of a fresh set-up on 2 cores)
      options={"build_ext": {"parallel": os.cpu_count() or 1}})
