/* AVX2 + FMA fast path of the paged decode kernel for 64-wide heads with up to 4 query heads
 * per KV head: paged_decode_head64.h's scheme on 8-lane registers, for CPUs without AVX-512.
 *
 * Why: the generic AVX2 path (paged_decode_isa.h) calls a dot and an axpy per (token, query
 * head) through function pointers and loads/stores each query head's accumulator once per
 * token: at batch 32, 190 tokens of context, SmolLM2's fp32 layer ran at ~13 GB/s on an AVX2
 * EPYC, a third of a copy of the same bytes. Here a K row's 8 registers serve every query
 * head of its group (the query values come from L1 as FMA operands: 16 ymm registers cannot
 * hold them too), and the V pass keeps the accumulators in registers, a quarter to the whole
 * head width at a time (fewer lanes per pass as the group grows, so that they fit). Same math:
 * fp32 scores, the shared softmax, fp32 sums; only the summation order differs. */
#ifndef KVSTRATA_PAGED_DECODE_HEAD64_AVX2_H
#define KVSTRATA_PAGED_DECODE_HEAD64_AVX2_H
#include "paged_decode_head64.h"

#if defined(__x86_64__)
#define LD8_F32(p) _mm256_loadu_ps((const float *)(p))
#define LD8_BF16(p) bf16x8_load(p)
#define LD8_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))

/* Scores of G query heads against each token's K head row (8 chunks of 8 lanes). */
#define H64A_SCORES(LOAD, ESZ, G)                                                           \
    for (int64_t t = 0; t < len; t++) {                                                     \
        PREFETCH_HEAD(k, ESZ)                                                               \
        const char *kr = k + sl[t] * row_bytes;                                             \
        __m256 s[G];                                                                        \
        {                                                                                   \
            const __m256 kc = LOAD(kr);                                                     \
            for (int i = 0; i < G; i++) s[i] = _mm256_mul_ps(_mm256_loadu_ps(q + i * 64), kc); \
        }                                                                                   \
        for (int c = 1; c < 8; c++) {                                                       \
            const __m256 kc = LOAD(kr + c * 8 * ESZ);                                       \
            for (int i = 0; i < G; i++)                                                     \
                s[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * 64 + c * 8), kc, s[i]);      \
        }                                                                                   \
        for (int i = 0; i < G; i++) scores[i * len + t] = hsum256(s[i]) * scale;            \
    }

/* The shared softmax, then each query head's sum of V rows, CW chunks of 8 lanes a pass
 * (G * CW accumulators + G weights + one V chunk <= 16 registers). */
#define H64A_VALUES(LOAD, ESZ, G, CW)                                                       \
    float inv[G];                                                                           \
    for (int i = 0; i < G; i++)                                                         \
        inv[i] = 1.f / softmax(scores + i * len, len, cap, sinks ? sinks + i : NULL);   \
    for (int c0 = 0; c0 < 8; c0 += CW) {                                                    \
        __m256 acc[G][CW];                                                                  \
        for (int i = 0; i < G; i++)                                                         \
            for (int c = 0; c < CW; c++) acc[i][c] = _mm256_setzero_ps();                   \
        for (int64_t t = 0; t < len; t++) {                                                 \
            if (c0 == 0) { PREFETCH_HEAD(v, ESZ) }                                          \
            const char *vr = v + sl[t] * row_bytes + c0 * 8 * ESZ;                          \
            __m256 p[G];                                                                    \
            for (int i = 0; i < G; i++) p[i] = _mm256_set1_ps(scores[i * len + t]);         \
            for (int c = 0; c < CW; c++) {                                                  \
                const __m256 vc = LOAD(vr + c * 8 * ESZ);                                   \
                for (int i = 0; i < G; i++) acc[i][c] = _mm256_fmadd_ps(p[i], vc, acc[i][c]); \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < G; i++) {                                                       \
            const __m256 s = _mm256_set1_ps(inv[i]);                                        \
            for (int c = 0; c < CW; c++)                                                    \
                _mm256_storeu_ps(o + i * 64 + (c0 + c) * 8, _mm256_mul_ps(acc[i][c], s));   \
        }                                                                                   \
    }

#define H64A(NAME, LOAD, ESZ, G, CW)                                                        \
    AVX2 static void NAME HEAD64_SIGNATURE {                                                \
        H64A_SCORES(LOAD, ESZ, G)                                                           \
        H64A_VALUES(LOAD, ESZ, G, CW)                                                       \
    }

#define H64A_ALL(TAG, LOAD, ESZ)                                                            \
    H64A(head64_avx2_##TAG##_1, LOAD, ESZ, 1, 8)                                            \
    H64A(head64_avx2_##TAG##_2, LOAD, ESZ, 2, 4)                                            \
    H64A(head64_avx2_##TAG##_3, LOAD, ESZ, 3, 4)                                            \
    H64A(head64_avx2_##TAG##_4, LOAD, ESZ, 4, 2)
H64A_ALL(f32, LD8_F32, 4)
H64A_ALL(bf16, LD8_BF16, 2)
H64A_ALL(f16, LD8_F16, 2)

static const head64_fn HEAD64_AVX2_TABLE[3][4] = {
    {head64_avx2_f32_1, head64_avx2_f32_2, head64_avx2_f32_3, head64_avx2_f32_4},
    {head64_avx2_bf16_1, head64_avx2_bf16_2, head64_avx2_bf16_3, head64_avx2_bf16_4},
    {head64_avx2_f16_1, head64_avx2_f16_2, head64_avx2_f16_3, head64_avx2_f16_4}};
#endif

/* The AVX2 fast path for this call, or `chosen` (another ISA's, or NULL: the generic path). */
static head64_fn pick_head64_avx2(head64_fn chosen, const kernels *kn, int64_t d,
                                  int64_t group, int dtype) {
#if defined(__x86_64__)
    if (kn->isa == ISA_AVX2 && d == 64 && group >= 1 && group <= 4)
        return HEAD64_AVX2_TABLE[dtype][group - 1];
#else
    (void)kn; (void)d; (void)group; (void)dtype;
#endif
    return chosen;
}
#endif
