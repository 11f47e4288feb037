/* AVX-512 fast path of the paged decode kernel for 64-wide heads (SmolLM2, Llama-3.2-1B,
 * Qwen2.5-0.5B ...) with up to 4 query heads per KV head: one KV head of one request at a
 * time, its query heads' vectors and their accumulators held in registers.
 *
 * The generic path (paged_decode_isa.h) converts each row into an fp32 scratch row and
 * loads/stores each query head's 64-float accumulator once per token; at batch 32 and 128
 * tokens of context that ran at ~10 GB/s, far below what the machine reads. Here a K or V
 * head row is loaded (and widened) once into 4 registers and used by every query head of
 * its group straight from registers. Same math: fp32 scores, the shared softmax, fp32 sums.
 * Specialised by macro per storage dtype and group size (the register arrays need constant
 * bounds to stay in registers). */
#ifndef KVSTRATA_PAGED_DECODE_HEAD64_H
#define KVSTRATA_PAGED_DECODE_HEAD64_H
#include "paged_decode_isa.h"

typedef void (*head64_fn)(const float *q, const char *k, const char *v, int64_t row_bytes,
                          const int64_t *sl, int64_t len, float scale, float *scores,
                          float *o, softmax_fn softmax, float cap, const float *sinks);

#if defined(__x86_64__)
#define LD_F32(p) _mm512_loadu_ps((const float *)(p))
#define LD_BF16(p) bf16x16_load(p)
#define LD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))

/* The head row PREFETCH_TOKENS tokens ahead (64 values of ESZ bytes: 2 or 4 lines). */
#define PREFETCH_HEAD(BASE, ESZ)                                                            \
    if (t + PREFETCH_TOKENS < len) {                                                        \
        const char *nx = BASE + sl[t + PREFETCH_TOKENS] * row_bytes;                        \
        for (int b = 0; b < 64 * ESZ; b += 64) __builtin_prefetch(nx + b, 0, 3);            \
    }

#define HEAD64_SIGNATURE                                                                    \
    (const float *q, const char *k, const char *v, int64_t row_bytes, const int64_t *sl,     \
     int64_t len, float scale, float *scores, float *o, softmax_fn softmax, float cap,      \
     const float *sinks)

/* Scores of G query heads (fp32 in registers) against each token's K head row. */
#define HEAD64_SCORES(LOAD, ESZ, G)                                                         \
    __m512 qv[G][4];                                                                        \
    for (int i = 0; i < G; i++)                                                             \
        for (int c = 0; c < 4; c++) qv[i][c] = _mm512_loadu_ps(q + i * 64 + c * 16);        \
    for (int64_t t = 0; t < len; t++) {                                                     \
        PREFETCH_HEAD(k, ESZ)                                                               \
        const char *kr = k + sl[t] * row_bytes;                                             \
        __m512 k0 = LOAD(kr), k1 = LOAD(kr + 16 * ESZ), k2 = LOAD(kr + 32 * ESZ),           \
               k3 = LOAD(kr + 48 * ESZ);                                                    \
        for (int i = 0; i < G; i++) {                                                       \
            __m512 s = _mm512_mul_ps(qv[i][0], k0);                                         \
            s = _mm512_fmadd_ps(qv[i][1], k1, s);                                           \
            s = _mm512_fmadd_ps(qv[i][2], k2, s);                                           \
            s = _mm512_fmadd_ps(qv[i][3], k3, s);                                           \
            scores[i * len + t] = _mm512_reduce_add_ps(s) * scale;                          \
        }                                                                                   \
    }

/* The shared softmax over the scores, then each query head's sum of V rows, normalised. */
#define HEAD64_VALUES(LOAD, ESZ, G)                                                         \
    float inv[G];                                                                           \
    for (int i = 0; i < G; i++)                                                         \
        inv[i] = 1.f / softmax(scores + i * len, len, cap, sinks ? sinks + i : NULL);   \
    __m512 acc[G][4];                                                                       \
    for (int i = 0; i < G; i++)                                                             \
        for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();                        \
    for (int64_t t = 0; t < len; t++) {                                                     \
        PREFETCH_HEAD(v, ESZ)                                                               \
        const char *vr = v + sl[t] * row_bytes;                                             \
        __m512 v0 = LOAD(vr), v1 = LOAD(vr + 16 * ESZ), v2 = LOAD(vr + 32 * ESZ),           \
               v3 = LOAD(vr + 48 * ESZ);                                                    \
        for (int i = 0; i < G; i++) {                                                       \
            __m512 p = _mm512_set1_ps(scores[i * len + t]);                                 \
            acc[i][0] = _mm512_fmadd_ps(p, v0, acc[i][0]);                                  \
            acc[i][1] = _mm512_fmadd_ps(p, v1, acc[i][1]);                                  \
            acc[i][2] = _mm512_fmadd_ps(p, v2, acc[i][2]);                                  \
            acc[i][3] = _mm512_fmadd_ps(p, v3, acc[i][3]);                                  \
        }                                                                                   \
    }                                                                                       \
    for (int i = 0; i < G; i++) {                                                           \
        __m512 s = _mm512_set1_ps(inv[i]);                                                  \
        for (int c = 0; c < 4; c++)                                                         \
            _mm512_storeu_ps(o + i * 64 + c * 16, _mm512_mul_ps(acc[i][c], s));             \
    }

#define HEAD64(NAME, LOAD, ESZ, G)                                                          \
    AVX512 static void NAME HEAD64_SIGNATURE {                                              \
        HEAD64_SCORES(LOAD, ESZ, G)                                                         \
        HEAD64_VALUES(LOAD, ESZ, G)                                                         \
    }

#define HEAD64_ALL(TAG, LOAD, ESZ)                                                          \
    HEAD64(head64_##TAG##_1, LOAD, ESZ, 1)                                                  \
    HEAD64(head64_##TAG##_2, LOAD, ESZ, 2)                                                  \
    HEAD64(head64_##TAG##_3, LOAD, ESZ, 3)                                                  \
    HEAD64(head64_##TAG##_4, LOAD, ESZ, 4)
HEAD64_ALL(f32, LD_F32, 4)
HEAD64_ALL(bf16, LD_BF16, 2)
HEAD64_ALL(f16, LD_F16, 2)

static const head64_fn HEAD64_TABLE[3][4] = {
    {head64_f32_1, head64_f32_2, head64_f32_3, head64_f32_4},
    {head64_bf16_1, head64_bf16_2, head64_bf16_3, head64_bf16_4},
    {head64_f16_1, head64_f16_2, head64_f16_3, head64_f16_4}};
#endif

/* The fast path for this call, or NULL (then the generic path runs). */
static head64_fn pick_head64(const kernels *kn, int64_t d, int64_t group, int dtype) {
#if defined(__x86_64__)
    if (kn->isa == ISA_AVX512 && d == 64 && group >= 1 && group <= 4)
        return HEAD64_TABLE[dtype][group - 1];
#else
    (void)kn; (void)d; (void)group; (void)dtype;
#endif
    return NULL;
}
#endif
