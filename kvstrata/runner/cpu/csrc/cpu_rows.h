/* What kvstrata's row-wise CPU ops (cpu_ops.c, int8_ops.c) decide per call: whether a row of
 * `width` elements takes the AVX-512F body (the CPU has it, KVSTRATA_CPU_ISA allows it, the
 * width is a multiple of 16), and how many OpenMP threads (torch's team) the rows are split
 * across: one below PARALLEL_MIN_BYTES, where the fork costs more than it saves. */
#ifndef KVSTRATA_CPU_ROWS_H
#define KVSTRATA_CPU_ROWS_H
#include <stdint.h>

#define PARALLEL_MIN_BYTES (256 << 10)

static inline int use_avx512(int64_t width, int isa_cap) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return isa_cap >= 2 && width % 16 == 0 && __builtin_cpu_supports("avx512f");
#else
    (void)width; (void)isa_cap;
    return 0;
#endif
}

/* The AVX2 + FMA + F16C body instead (width % 8 == 0), on a CPU without AVX-512F or with
 * KVSTRATA_CPU_ISA=avx2. */
static inline int use_avx2(int64_t width, int isa_cap) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return isa_cap >= 1 && width % 8 == 0 && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    (void)width; (void)isa_cap;
    return 0;
#endif
}

static inline int thread_count(int threads, int64_t rows, int64_t bytes) {
#ifdef _OPENMP
    if (bytes < PARALLEL_MIN_BYTES || threads < 1) return 1;
    return rows < threads ? (int)(rows > 0 ? rows : 1) : threads;
#else
    (void)threads; (void)rows; (void)bytes;
    return 1;
#endif
}
#endif
