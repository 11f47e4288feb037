/* Vector primitives shared by kvstrata's CPU extensions (runner/cpu/csrc/cpu_ops.c and the paged
 * decode kernel, runner/attention/csrc/): 16-bit float conversions and exp for softmax /
 * sigmoid arguments, as scalar code and per instruction set. Callers pick the set at run
 * time (__builtin_cpu_supports); nothing here is compiled for one fixed ISA. */
#ifndef KVSTRATA_CPU_VEC_H
#define KVSTRATA_CPU_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(KVSTRATA_EMULATE_AVX512) /* the tests' build of the AVX-512 bodies on AVX2 */
#include "isa_emulation.h"
#define KVS_TARGET(sets)
#elif defined(__x86_64__)
#include <immintrin.h>
#define KVS_TARGET(sets) __attribute__((target(sets)))
#endif

/* ---- scalar ----------------------------------------------------------------------------- */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f32_to_bf16(float f) { /* round to nearest even (inputs are finite) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float f16_to_f32(uint16_t h) { /* IEEE half: subnormals, inf and nan kept */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* silu(g) = g * sigmoid(g): the scalar form, and below the AVX-512 one (exp of -|g| only);
 * every fused op that applies silu uses these two, so fused and unfused paths agree. */
static inline float silu_f(float g) { return g / (1.f + expf(-g)); }

#if defined(__x86_64__)
#define AVX2 KVS_TARGET("avx2,fma,f16c")
#define AVX512 KVS_TARGET("avx512f")
/* exp(x) for x <= 0: 2^n * e^r, r = x - n ln2 in [-ln2/2, ln2/2], e^r by its degree-6 Taylor
 * polynomial (truncation error < 2e-7 relative, about 1-2 ulp). Inputs below -87 are
 * clamped: e^-87 is ~1e-38, nothing next to a softmax's max term of 1. One body, two
 * widths: the macro takes the intrinsic prefix, the vector type, and the width's
 * round-to-nearest and times-2^n helpers. */
#define EXP_NONPOS_BODY(P, V, ROUND, POW2)                                                 \
    x = P##_max_ps(x, P##_set1_ps(-87.0f));                                                \
    V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)));                         \
    V r = P##_fnmadd_ps(n, P##_set1_ps(0.693145751953125f), x);                            \
    r = P##_fnmadd_ps(n, P##_set1_ps(1.428606765330187e-06f), r);                          \
    V p = P##_set1_ps(1.f / 720.f);                                                        \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.f / 120.f));                                      \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.f / 24.f));                                       \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.f / 6.f));                                        \
    p = P##_fmadd_ps(p, r, P##_set1_ps(0.5f));                                             \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.f));                                              \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.f));                                              \
    return POW2(p, n);

#define ROUND_NEAREST_256(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ROUND_NEAREST_512(v) \
    _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
AVX2 static inline __m256 pow2_times_256(__m256 p, __m256 n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
AVX512 static inline __m512 pow2_times_512(__m512 p, __m512 n) { return _mm512_scalef_ps(p, n); }

AVX2 static inline __m256 exp_nonpos_avx2(__m256 x) {
    EXP_NONPOS_BODY(_mm256, __m256, ROUND_NEAREST_256, pow2_times_256)
}
AVX512 static inline __m512 exp_nonpos_avx512(__m512 x) {
    EXP_NONPOS_BODY(_mm512, __m512, ROUND_NEAREST_512, pow2_times_512)
}

/* 16 bf16 values -> fp32; fp32 -> bf16 (round to nearest even); fp32 rounded through bf16. */
AVX512 static inline __m512 bf16x16_load(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
AVX512 static inline __m256i bf16x16_from(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}
AVX512 static inline __m512 bf16x16_round(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_from(f)), 16));
}
/* The same three at AVX2 width (8 values); bf16x8_bits keeps the rounded bf16 in the high
 * half of each lane (an fp32 holding exactly that bf16 value). */
AVX2 static inline __m256 bf16x8_load(const void *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
AVX2 static inline __m256i bf16x8_bits(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    return _mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u));
}
AVX2 static inline __m256 bf16x8_round(__m256 f) { return _mm256_castsi256_ps(bf16x8_bits(f)); }
AVX2 static inline __m128i bf16x8_from(__m256 f) {
    __m256i v = _mm256_srli_epi32(bf16x8_bits(f), 16); /* <= 0xffff: packus keeps it exactly */
    return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}
AVX2 static inline __m256 silu_v8(__m256 g) { /* silu_v below, 8 lanes: the same arithmetic */
    const __m256 zero = _mm256_setzero_ps();
    __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.f), g);
    __m256 e = exp_nonpos_avx2(_mm256_sub_ps(zero, abs));
    __m256 den = _mm256_add_ps(_mm256_set1_ps(1.f), e);
    __m256 neg = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
    __m256 sig = _mm256_div_ps(_mm256_blendv_ps(_mm256_set1_ps(1.f), e, neg), den);
    return _mm256_mul_ps(g, sig);
}
AVX512 static inline __m512 silu_v(__m512 g) { /* g * sigmoid(g), exp of -|g| only */
    __m512 e = exp_nonpos_avx512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), e);
    __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, _mm512_set1_ps(1.f), e), den);
    return _mm512_mul_ps(g, sig);
}
#endif
#endif
