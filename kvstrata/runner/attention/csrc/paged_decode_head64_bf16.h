/* The 64-wide head path for a bf16 query over a bf16 pool on a CPU with AVX512-BF16: the
 * scores by vdpbf16ps, straight from the pool's bf16 rows, four tokens' sums at once.
 *
 * Why: the fp32 score pass widens every K row (8 instructions per 64-value row) and reduces
 * each (token, query head) dot product across 16 lanes on its own (~8 instructions); at batch
 * 32, 190 tokens of context, SmolLM2's layer took ~240 us on one thread from cache, 2.3x a copy
 * of the same bytes: the kernel was bound by instructions, not memory. Here a K head row is two
 * 64-byte loads multiplied in bf16 pairs (the query's values are bf16 to begin with, so
 * converting them back is exact; products are exact in fp32 as before), and the lane sums of
 * four tokens are reduced together (~3.5 instructions a score). Sums run in another order than
 * the fp32 pass, so results match it to fp32 rounding, not bit for bit. The value pass
 * (HEAD64_VALUES_BF16) widens V rows with half the instructions and sums exactly as
 * HEAD64_VALUES does. Measured on that layer (2 threads, rows in cache, AVX-512 EPYC):
 * 148-154 -> 113-114 us a call.
 * The score pass also asks for the V row it will need (PREFETCH_TOKENS ahead, and the first
 * PREFETCH_TOKENS rows of both before it starts), so the value pass finds its rows in cache
 * and neither pass starts on cold rows: the kernel waits on memory, not on instructions
 * (perf: the loads' consumers hold the samples). 30 layers at batch 32, 190 tokens, pools in
 * huge pages, 2 threads, AVX-512 BF16 EPYC: 9.5-10.1 -> 8.0-8.7 ms with each request's rows
 * in order, 13.3-14.1 -> 11.6-11.9 ms with its pages shuffled over a large pool. */
#ifndef KVSTRATA_PAGED_DECODE_HEAD64_BF16_H
#define KVSTRATA_PAGED_DECODE_HEAD64_BF16_H
#include "paged_decode_head64.h"

#if defined(__x86_64__)
#define AVX512_BF16 KVS_TARGET("avx512f,avx512bw,avx512dq,avx512bf16")

/* [sum(a), sum(b), sum(c), sum(d)] of four 16-lane vectors. */
AVX512_BF16 static inline __m128 sum4_of_16(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* quarters: ab = [a0+a2, a1+a3, b0+b2, b1+b3], cd likewise */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44),
                                    _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44),
                                    _mm512_shuffle_f32x4(c, d, 0xEE));
    /* quarter j: four partial sums of vector j */
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88),
                             _mm512_shuffle_f32x4(ab, cd, 0xDD));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
    const __m512i lane0s = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(lane0s, u));
}

/* Token TOKEN's K head row (for the score pass) and V head row (the value pass: into L2). */
#define PREFETCH_KV(TOKEN)                                                                  \
    {                                                                                       \
        const int64_t at_ = sl[TOKEN] * row_bytes;                                          \
        __builtin_prefetch(k + at_, 0, 3);                                                  \
        __builtin_prefetch(k + at_ + 64, 0, 3);                                             \
        __builtin_prefetch(v + at_, 0, 2);                                                  \
        __builtin_prefetch(v + at_ + 64, 0, 2);                                             \
    }

/* One token's 16-lane partial dot products of G query heads with its K head row. */
#define DP_ROW(S, U, G)                                                                      \
    {                                                                                       \
        const int64_t tt = t + (U);                                                         \
        if (tt + PREFETCH_TOKENS < len) PREFETCH_KV(tt + PREFETCH_TOKENS)                  \
        const char *kr = k + sl[tt] * row_bytes;                                            \
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr);                               \
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kr + 64);                          \
        for (int i = 0; i < G; i++)                                                         \
            S[i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), k0, qb[i][0]), k1, \
                                    qb[i][1]);                                              \
    }

/* HEAD64_VALUES for bf16 rows with half the widening work: a 64-byte load holds 32 values;
 * shifted left by 16 its 32-bit lanes are the even-indexed values as fp32, masked to the high
 * half the odd ones (one instruction each, against two per 16 values through cvtepu16). The
 * accumulators hold even and odd columns apart and are interleaved once at the end. */
#define HEAD64_VALUES_BF16(G)                                                               \
    float inv[G];                                                                           \
    for (int i = 0; i < G; i++)                                                         \
        inv[i] = 1.f / softmax(scores + i * len, len, cap, sinks ? sinks + i : NULL);   \
    __m512 ev[G][2], od[G][2];                                                              \
    for (int i = 0; i < G; i++)                                                             \
        for (int c = 0; c < 2; c++) ev[i][c] = od[i][c] = _mm512_setzero_ps();              \
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);                               \
    for (int64_t t = 0; t < len; t++) {                                                     \
        PREFETCH_HEAD(v, 2)                                                                 \
        const char *vr = v + sl[t] * row_bytes;                                             \
        const __m512i x0 = _mm512_loadu_si512(vr), x1 = _mm512_loadu_si512(vr + 64);       \
        const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16));                   \
        const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(x0, high));                  \
        const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(x1, 16));                   \
        const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(x1, high));                  \
        for (int i = 0; i < G; i++) {                                                       \
            const __m512 p = _mm512_set1_ps(scores[i * len + t]);                           \
            ev[i][0] = _mm512_fmadd_ps(p, e0, ev[i][0]);                                    \
            od[i][0] = _mm512_fmadd_ps(p, o0, od[i][0]);                                    \
            ev[i][1] = _mm512_fmadd_ps(p, e1, ev[i][1]);                                    \
            od[i][1] = _mm512_fmadd_ps(p, o1, od[i][1]);                                    \
        }                                                                                   \
    }                                                                                       \
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22,   \
                                         7, 23);                                            \
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));                          \
    for (int i = 0; i < G; i++) {                                                           \
        const __m512 s = _mm512_set1_ps(inv[i]);                                            \
        for (int c = 0; c < 2; c++) {                                                       \
            float *oc = o + i * 64 + c * 32;                                                \
            _mm512_storeu_ps(oc, _mm512_mul_ps(_mm512_permutex2var_ps(ev[i][c], lo,         \
                                                                      od[i][c]), s));       \
            _mm512_storeu_ps(oc + 16, _mm512_mul_ps(_mm512_permutex2var_ps(ev[i][c], hi,    \
                                                                           od[i][c]), s));  \
        }                                                                                   \
    }

#define HEAD64_BF16(NAME, G)                                                                \
    AVX512_BF16 static void NAME HEAD64_SIGNATURE {                                         \
        __m512bh qb[G][2];                                                                  \
        for (int i = 0; i < G; i++)                                                         \
            for (int c = 0; c < 2; c++)                                                     \
                qb[i][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + i * 64 + c * 32 + 16),    \
                                               _mm512_loadu_ps(q + i * 64 + c * 32));       \
        const __m128 sc = _mm_set1_ps(scale);                                               \
        for (int64_t u = 0; u < len && u < PREFETCH_TOKENS; u++) PREFETCH_KV(u)             \
        int64_t t = 0;                                                                      \
        for (; t + 4 <= len; t += 4) {                                                      \
            __m512 s0[G], s1[G], s2[G], s3[G];                                              \
            DP_ROW(s0, 0, G) DP_ROW(s1, 1, G) DP_ROW(s2, 2, G) DP_ROW(s3, 3, G)                   \
            for (int i = 0; i < G; i++)                                                     \
                _mm_storeu_ps(scores + i * len + t,                                         \
                              _mm_mul_ps(sum4_of_16(s0[i], s1[i], s2[i], s3[i]), sc));      \
        }                                                                                   \
        for (; t < len; t++) {                                                              \
            __m512 s0[G];                                                                   \
            DP_ROW(s0, 0, G)                                                                \
            for (int i = 0; i < G; i++)                                                     \
                scores[i * len + t] = _mm512_reduce_add_ps(s0[i]) * scale;                  \
        }                                                                                   \
        HEAD64_VALUES_BF16(G)                                                               \
    }

HEAD64_BF16(head64_bf16dp_1, 1)
HEAD64_BF16(head64_bf16dp_2, 2)
HEAD64_BF16(head64_bf16dp_3, 3)
HEAD64_BF16(head64_bf16dp_4, 4)

static const head64_fn HEAD64_BF16DP_TABLE[4] = {head64_bf16dp_1, head64_bf16dp_2,
                                                 head64_bf16dp_3, head64_bf16dp_4};
#endif

/* The bf16-dot path for a bf16 query over a bf16 pool where the CPU has AVX512-BF16 and the
 * fp32 head64 path was chosen; else that choice unchanged. */
static head64_fn pick_head64_bf16(head64_fn chosen, int64_t group, int q_bf16, int kv_dtype) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (chosen && q_bf16 && kv_dtype == 1 && __builtin_cpu_supports("avx512bf16"))
        return HEAD64_BF16DP_TABLE[group - 1];
#else
    (void)group; (void)q_bf16; (void)kv_dtype;
#endif
    return chosen;
}
#endif
