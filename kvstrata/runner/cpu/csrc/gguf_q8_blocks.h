/* GGUF weight blocks times 8-bit activations (llama.cpp's scheme, our code): each fp32 row
 * of x is quantized once per call to blocks of 32 (Q8_0-style: a float scale d = amax / 127
 * and 32 int8 q = round-half-even(x / d), plus s = d * sum(q) for the formats with a min);
 * each 32-weight group of a weight row (gguf_blocks_avx2.h's header lists the layouts) is
 * unpacked to its 32 integer weights, and the group's dot product is integer: eight int32
 * lane sums (lane i: weights 4i..4i+3 times their q), exact. Then per group, in k order, in
 * fp32: acc[i] = fma(float(lane_i), w_scale * d, acc[i]) (Q6_K: lanes 0-3 and 4-7 take the
 * scales of their 16 weights); for Q4_1 / Q5_1 / Q4_K / Q5_K also, in eight lanes by group
 * (lane g % 8), acc_min[g % 8] = fma(w_min_g, s_g, acc_min[g % 8]) (after the groups, from
 * the mins saved while unpacking: off the inner loop); an output is
 * gg_hsum(acc) + gg_hsum(acc_min).
 *
 * Every step is per row and per output, in one order, and the integer sums are exact, so a
 * row's output does not depend on how many rows share the call or how the columns are split
 * over threads (batch invariance), and this file's portable body (plain C, fmaf) gives the
 * AVX2 body's bits exactly. AVX2: _mm256_maddubs_epi16 (unsigned x signed bytes) and
 * _mm256_madd_epi16 sum the products; signed weights use the sign trick (|w| times x with
 * w's sign). Nothing saturates: |x q| <= 127, |w| <= 128, so a pair sums to at most 32512.
 *
 * The weight ints and scales per group: gguf_blocks_avx2.h's gg_group_ints (and its portable
 * twin in gguf_blocks_scalar.h), which the float path's dequantization is built on too.
 */
#ifndef KVSTRATA_GGUF_Q8_BLOCKS_H
#define KVSTRATA_GGUF_Q8_BLOCKS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "gguf_blocks_avx2.h"
#include "gguf_blocks_scalar.h"

#define Q8_MAGIC 12582912.0f /* 1.5 * 2^23: (v + M) - M rounds v half-to-even, |v| < 2^22 */

/* A row's activation blocks: q [k] int8, d and s [k / 32] (s = d * sum of the block's q). */
#define Q8_QUANTIZE_BODY                                                   \
    for (int64_t g = 0; g < k / 32; g++) {                                 \
        const float *xb = x + g * 32;                                      \
        float amax = 0.0f;                                                 \
        for (int i = 0; i < 32; i++) {                                     \
            const float v = fabsf(xb[i]);                                  \
            amax = v > amax ? v : amax;                                    \
        }                                                                  \
        const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f; \
        int sum = 0;                                                       \
        for (int i = 0; i < 32; i++) {                                     \
            float v = (xb[i] * id + Q8_MAGIC) - Q8_MAGIC;                  \
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);         \
            q[g * 32 + i] = (int8_t)v;                                     \
            sum += (int)v;                                                 \
        }                                                                  \
        d[g] = dd;                                                         \
        s[g] = dd * (float)sum;                                            \
    }

static void q8_quantize_row(const float *x, int64_t k, int8_t *q, float *d, float *s) {
    Q8_QUANTIZE_BODY
}

/* One output of the portable body: weight row w_row against a row's activation blocks. */
static inline float q8_dot_scalar(const int qt, const uint8_t *w_row, const int8_t *xq,
                                  const float *xd, const float *xs, int64_t k) {
    float acc[8] = {0}, acc_min[8] = {0};
    int w[32];
    gg_scales sc;
    for (int64_t g = 0; g < k / 32; g++) {
        gg_group_ints_scalar(qt, w_row, g, w, &sc);
        const int8_t *x = xq + g * 32;
        for (int i = 0; i < 8; i++) {
            const int lane = w[4 * i] * x[4 * i] + w[4 * i + 1] * x[4 * i + 1] +
                             w[4 * i + 2] * x[4 * i + 2] + w[4 * i + 3] * x[4 * i + 3];
            acc[i] = fmaf((float)lane, (i < 4 ? sc.scale0 : sc.scale1) * xd[g], acc[i]);
        }
        if (gg_has_min(qt)) acc_min[g & 7] = fmaf(sc.min, xs[g], acc_min[g & 7]);
    }
    return gg_hsum_scalar(acc) + gg_hsum_scalar(acc_min);
}

#if defined(__x86_64__)
GG_AVX2 static void q8_quantize_row_avx2(const float *x, int64_t k, int8_t *q, float *d,
                                         float *s) {
    Q8_QUANTIZE_BODY /* the same C, vectorized by the compiler: the same IEEE operations */
}

static inline int q8_signed_weights(const int qt) { return !gg_has_min(qt); }

/* Eight int32 lane sums of w times x (lane i: bytes 4i..4i+3); |w| prepared as `wabs` for
 * signed weights (the sign trick), w itself for unsigned ones. */
GG_AVX2 static GG_INLINE __m256i q8_lanes(const int is_signed, __m256i w, __m256i wabs,
                                          __m256i x) {
    const __m256i pairs = is_signed ? _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w))
                                    : _mm256_maddubs_epi16(w, x);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* The same lane sums in one vpdpbusd (AVX-512 VNNI on 256-bit registers): it adds the four
 * byte products of a lane in int32 without the int16 pair step, whose sums never saturate
 * here, so the lanes are q8_lanes' exactly. */
#define GG_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
GG_VNNI static GG_INLINE __m256i q8_lanes_vnni(const int is_signed, __m256i w, __m256i wabs,
                                               __m256i x) {
    return is_signed ? _mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, _mm256_sign_epi8(x, w))
                     : _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}
#endif
#endif
