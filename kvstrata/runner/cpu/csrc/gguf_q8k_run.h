/* The K-quants (Q4_K, Q5_K, Q6_K) times 8-bit activations with integer sub-block scales:
 * llama.cpp's vec_dot_q*_K_q8_K scheme, our code. gguf_q8_run.h's general path quantizes x in
 * blocks of 32 and pays, per 32-weight group and row, a float scale product, an int -> float
 * convert and an FMA, after decoding the group's 6-bit scale and min and two f16s to float.
 * Here x is quantized in super-blocks of 256 (one float d per 256 values, as the weights'
 * super-block), so inside a super-block the whole dot product stays in integers:
 *
 *   Q4_K / Q5_K: sumi = sum_j sc_j * dot_j (dot_j: the 32 unsigned weight ints of group j
 *                times x's ints, sc_j its 6-bit scale), summ = sum_j m_j * xsum_j (m_j its
 *                6-bit min, xsum_j the sum of x's 32 ints of group j);
 *                out += (d * xd) * sumi - (dmin * xd) * summ
 *   Q6_K:        sumi = sum over 16-weight halves of sc16 * dot16 (signed 8-bit scales,
 *                weights q - 32);  out += (d * xd) * sumi
 *
 * sumi is kept in eight int32 lanes (lane i: weights 4i..4i+3 of each group; for Q6_K lanes
 * 0-3 and 4-7 take the scales of their 16 weights), the scale applied to the int16 pair sums
 * (vpmaddwd with the scale for AVX2, vpdpwssd on AVX-512 VNNI: the same exact int32s); then,
 * once per super-block and row, acc[i] = fma(float(sumi_i), d * xd, acc[i]) and, for the
 * formats with a min, minacc = fma(float(summ), dmin * xd, minacc). An output is
 * gg_hsum(acc) - minacc. Nothing overflows: a Q6_K lane is at most 8 groups x 4 x 32 x 127 x
 * 128 < 2^24, a Q4_K / Q5_K lane 8 x 4 x 31 x 127 x 63 < 2^23, and the int16 pair sums
 * (|w| <= 32 and x in [-127, 127]: <= 8128) never saturate.
 *
 * As in gguf_q8_blocks.h every step is per row and per output in one order and the integer
 * sums are exact, so the AVX2, VNNI and portable bodies give the same bits, batch-invariant.
 * The coarser activation blocks round x to amax(256) / 254 instead of amax(32) / 254
 * (tests/correctness/test_gguf_q8k_matmul.py bounds both against gguf's float product). */
#ifndef KVSTRATA_GGUF_Q8K_RUN_H
#define KVSTRATA_GGUF_Q8K_RUN_H
#include <math.h>
#include <stdlib.h>
#include "cpu_rows.h"
#include "gguf_pool.h"
#include "gguf_q8_blocks.h"

#define Q8K_QUAD 4      /* output columns per weight sweep */
#define Q8K_TILE_ROWS 4 /* rows of x per unpacked weight group */
#define Q8K_ROW_BLOCK 64

typedef struct {
    const uint8_t *w;
    int64_t row_bytes, n, k;
    const int8_t *xq;    /* [m, k] */
    const float *xd;     /* [m, k / 256] */
    const int16_t *xsum; /* [m, k / 32]: each 32-group's sum of xq */
    float *out;
    int64_t out_stride;
} q8k_args;

typedef struct {
    const q8k_args *a;
    pool_grid grid;
} q8k_job;

/* One row's super-blocks: d = amax / 127 over 256 values, q = round-half-even(x / d) as
 * Q8_QUANTIZE_BODY rounds, and the sums of q per group of 32. */
#define Q8K_QUANTIZE_BODY                                                  \
    for (int64_t sb = 0; sb < k / 256; sb++) {                             \
        const float *xb = x + sb * 256;                                    \
        float amax = 0.0f;                                                 \
        for (int i = 0; i < 256; i++) {                                    \
            const float v = fabsf(xb[i]);                                  \
            amax = v > amax ? v : amax;                                    \
        }                                                                  \
        const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f; \
        for (int g = 0; g < 8; g++) {                                      \
            int sum = 0;                                                   \
            for (int i = 32 * g; i < 32 * g + 32; i++) {                   \
                float v = (xb[i] * id + Q8_MAGIC) - Q8_MAGIC;              \
                v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);     \
                q[sb * 256 + i] = (int8_t)v;                               \
                sum += (int)v;                                             \
            }                                                              \
            xsum[sb * 8 + g] = (int16_t)sum;                               \
        }                                                                  \
        d[sb] = dd;                                                        \
    }

static void q8k_quantize_row(const float *x, int64_t k, int8_t *q, float *d, int16_t *xsum) {
    Q8K_QUANTIZE_BODY
}

#if defined(__x86_64__)
GG_AVX2 static void q8k_quantize_row_avx2(const float *x, int64_t k, int8_t *q, float *d,
                                          int16_t *xsum) {
    Q8K_QUANTIZE_BODY /* the same C, vectorized by the compiler: the same IEEE operations */
}
#endif

/* A Q4_K / Q5_K super-block's eight 6-bit scales and mins as bytes (the 12-byte field at
 * offset 4: scales 0-3 and mins 0-3 in the low 6 bits of bytes 0-7, scales / mins 4-7 in the
 * nibbles of bytes 8-11 with their top 2 bits in the top bits of bytes 0-7): what
 * gg_scale_min_k4 gives for j = 0..7, four at a time in 32-bit words. */
static GG_INLINE void q8k_scales_mins(const uint8_t *s12, uint8_t sc[8], uint8_t mn[8]) {
    uint32_t u[3], out[4];
    memcpy(u, s12, 12);
    const uint32_t low6 = 0x3f3f3f3fu, nib = 0x0f0f0f0fu, top2 = 0x03030303u;
    out[0] = u[0] & low6;                                     /* scales 0-3 */
    out[1] = (u[2] & nib) | (((u[0] >> 6) & top2) << 4);      /* scales 4-7 */
    out[2] = u[1] & low6;                                     /* mins 0-3 */
    out[3] = ((u[2] >> 4) & nib) | (((u[1] >> 6) & top2) << 4); /* mins 4-7 */
    memcpy(sc, out, 8);
    memcpy(mn, out + 2, 8);
}

/* One output of the portable body, the vector bodies' operations in their order. */
static inline float q8k_dot_scalar(const int qt, const uint8_t *w_row, const int8_t *xq,
                                   const float *xd, const int16_t *xsum, int64_t k) {
    const int bb = gg_block_bytes(qt);
    float acc[8] = {0}, minacc = 0.0f;
    int w[32];
    gg_scales unused;
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *b = w_row + sb * bb;
        uint8_t sc[8], mn[8];
        int sumi[8] = {0}, summ = 0;
        if (qt != GG_Q6_K) q8k_scales_mins(b + 4, sc, mn);
        for (int j = 0; j < 8; j++) {
            gg_group_ints_scalar(qt, w_row, sb * 8 + j, w, &unused);
            const int8_t *x = xq + sb * 256 + 32 * j;
            for (int i = 0; i < 8; i++) {
                const int scale = qt == GG_Q6_K ? (int8_t)b[192 + 2 * j + (i >= 4)] : sc[j];
                sumi[i] += scale * (w[4 * i] * x[4 * i] + w[4 * i + 1] * x[4 * i + 1] +
                                    w[4 * i + 2] * x[4 * i + 2] + w[4 * i + 3] * x[4 * i + 3]);
            }
            if (qt != GG_Q6_K) summ += mn[j] * xsum[sb * 8 + j];
        }
        const float dd = gg_f16_scalar(b + (qt == GG_Q6_K ? 208 : 0)) * xd[sb];
        for (int i = 0; i < 8; i++) acc[i] = fmaf((float)sumi[i], dd, acc[i]);
        if (qt != GG_Q6_K) minacc = fmaf((float)summ, gg_f16_scalar(b + 2) * xd[sb], minacc);
    }
    return gg_hsum_scalar(acc) - minacc;
}

static void q8k_run_scalar(int qt, const q8k_args *a, int64_t m, int threads) {
    const int nt = thread_count(threads, a->n, a->row_bytes * a->n);
    const int64_t sbs = a->k / 256;
    for (int64_t r = 0; r < m; r++) {
        float *out = a->out + r * a->out_stride;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
        for (int64_t j = 0; j < a->n; j++)
            out[j] = q8k_dot_scalar(qt, a->w + j * a->row_bytes, a->xq + r * a->k,
                                    a->xd + r * sbs, a->xsum + r * sbs * 8, a->k);
    }
}

#if defined(__x86_64__)
/* Eight int32 lanes of scale16 times the int16 pair sums of w times x: AVX2 (vpmaddwd) and
 * AVX-512 VNNI (vpdpwssd, accumulating), the same exact sums. */
GG_AVX2 static GG_INLINE __m256i q8k_add_scaled(__m256i sumi, __m256i pairs, __m256i scale16) {
    return _mm256_add_epi32(sumi, _mm256_madd_epi16(pairs, scale16));
}
GG_VNNI static GG_INLINE __m256i q8k_add_scaled_vnni(__m256i sumi, __m256i pairs,
                                                     __m256i scale16) {
    return _mm256_dpwssd_epi32(sumi, pairs, scale16);
}

#define Q8K_TARGET GG_AVX2
#define Q8K_FN(name) name##_avx2
#define Q8K_ADD_SCALED q8k_add_scaled
#include "gguf_q8k_tiles.h"
#undef Q8K_TARGET
#undef Q8K_FN
#undef Q8K_ADD_SCALED
#define Q8K_TARGET GG_VNNI
#define Q8K_FN(name) name##_vnni
#define Q8K_ADD_SCALED q8k_add_scaled_vnni
#include "gguf_q8k_tiles.h"
#undef Q8K_TARGET
#undef Q8K_FN
#undef Q8K_ADD_SCALED
#endif

/* Whether a format takes this path: a K-quant, unless switched off (gguf_ops.c's
 * use_superblocks, KVSTRATA_GGUF_Q8_SUPERBLOCKS=0: the 32-block path, for A/B). */
static int q8k_format(int qt) { return qt == GG_Q4_K || qt == GG_Q5_K || qt == GG_Q6_K; }

/* matmul_q8 for a K-quant, x fp32 [m, k]: -1 when out of memory. */
static int q8k_matmul(int qt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                      const float *x, int64_t m, float *out, int64_t out_stride, int threads,
                      int avx2, int vnni) {
    const int64_t sbs = m * (k / 256);
    char *mem = malloc((size_t)(m * k) + sizeof(float) * (size_t)sbs +
                       sizeof(int16_t) * 8 * (size_t)sbs + 128);
    if (!mem) return -1;
    int8_t *q = (int8_t *)mem;
    float *d = (float *)(mem + ((m * k + 63) & ~(int64_t)63));
    int16_t *xsum = (int16_t *)(d + sbs);
    for (int64_t r = 0; r < m; r++) {
        const int64_t rs = r * (k / 256);
#if defined(__x86_64__)
        if (avx2) {
            q8k_quantize_row_avx2(x + r * k, k, q + r * k, d + rs, xsum + rs * 8);
            continue;
        }
#endif
        q8k_quantize_row(x + r * k, k, q + r * k, d + rs, xsum + rs * 8);
    }
    const q8k_args a = {w, row_bytes, n, k, q, d, xsum, out, out_stride};
    if (!avx2) q8k_run_scalar(qt, &a, m, threads);
#if defined(__x86_64__)
    else if (vnni) q8k_run_vnni(qt, &a, m, threads);
    else q8k_run_avx2(qt, &a, m, threads);
#endif
    (void)vnni;
    free(mem);
    return 0;
}
#endif
