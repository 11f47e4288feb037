/* gguf_ops.c's matmul with 8-bit activations (gguf_q8_blocks.h: the scheme and why it is
 * batch-invariant): x's rows quantized once per call into q8_rows, then the output columns in
 * quads split statically over torch's OpenMP team, each output computed whole by one thread.
 * Inside a quad, rows in tiles of up to Q8_TILE_ROWS (4; 2 and 3 measured no faster): each
 * weight group is unpacked once per tile and dotted with every row of the tile (the packed
 * quad stays in L1 across the tiles). Per group and row the float work (convert, scale
 * product, FMA) is what bounds it at many rows: at 32 rows it runs ~0.6x gguf_ops.c's float
 * panels, whose 3 x 4 FMA tiles need no per-group scale (docs/benchmarks.md). */
#ifndef KVSTRATA_GGUF_Q8_RUN_H
#define KVSTRATA_GGUF_Q8_RUN_H
#include <stdlib.h>
#include "cpu_rows.h"
#include "gguf_q8_blocks.h"

#define Q8_QUAD 4
#define Q8_TILE_ROWS 4
#define Q8_ROW_BLOCK 64

typedef struct {
    const uint8_t *w;
    int64_t row_bytes, n, k;
    const int8_t *xq; /* [m, k] */
    const float *xd, *xs; /* [m, k / 32] */
    float *out;
    int64_t out_stride;
} q8_args;

/* x [m, k] fp32 -> its activation blocks (one malloc: q, then d, then s); NULL if out of memory. */
static void *q8_rows(const float *x, int64_t m, int64_t k, int avx2, q8_args *a) {
    const int64_t blocks = m * (k / 32);
    char *mem = malloc((size_t)(m * k) + sizeof(float) * 2 * (size_t)blocks + 64);
    if (!mem) return NULL;
    int8_t *q = (int8_t *)mem;
    float *d = (float *)(mem + ((m * k + 63) & ~(int64_t)63)), *s = d + blocks;
    for (int64_t r = 0; r < m; r++) {
#if defined(__x86_64__)
        if (avx2) {
            q8_quantize_row_avx2(x + r * k, k, q + r * k, d + r * (k / 32), s + r * (k / 32));
            continue;
        }
#endif
        (void)avx2;
        q8_quantize_row(x + r * k, k, q + r * k, d + r * (k / 32), s + r * (k / 32));
    }
    a->xq = q, a->xd = d, a->xs = s;
    return mem;
}

/* The portable body: each output whole (q8_dot_scalar), the AVX2 body's bits. */
static void q8_run_scalar(int qt, const q8_args *a, int64_t m, int threads) {
    const int nt = thread_count(threads, a->n, a->row_bytes * a->n);
    const int64_t groups = a->k / 32;
    for (int64_t r = 0; r < m; r++) {
        float *out = a->out + r * a->out_stride;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
        for (int64_t j = 0; j < a->n; j++)
            out[j] = q8_dot_scalar(qt, a->w + j * a->row_bytes, a->xq + r * a->k,
                                   a->xd + r * groups, a->xs + r * groups, a->k);
    }
}

#if defined(__x86_64__)
/* The min terms of rows r0.. x columns j0..: sum over groups of mins[c][g] * s[r][g], in
 * eight lanes by group (the tail's lanes masked to + 0 * 0, which leaves them as they are). */
GG_AVX2 static GG_INLINE float q8_min_term(const float *mins, const float *xs, int64_t groups) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + g), _mm256_loadu_ps(xs + g), acc);
    if (g < groups) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(groups - g)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(mins + g, mask),
                              _mm256_maskload_ps(xs + g, mask), acc);
    }
    return gg_hsum(acc);
}

/* Columns j0.. (nc) x rows r0.. (mr): per group, each column's weights unpacked once, dotted
 * with each row's block; scale and sum as q8_dot_scalar does, lane for lane. `mins`: scratch
 * [Q8_QUAD][groups] for the formats with a min. */
GG_AVX2 static GG_INLINE void q8_tile(const int qt, const q8_args *a, int64_t r0, const int mr,
                                      int64_t j0, const int nc, float *mins) {
    __m256 acc[Q8_TILE_ROWS][Q8_QUAD];
    const uint8_t *row[Q8_QUAD];
    const int is_signed = q8_signed_weights(qt), has_min = gg_has_min(qt);
    const int64_t groups = a->k / 32;
    const int8_t *xq[Q8_TILE_ROWS];
    const float *xd[Q8_TILE_ROWS];
    for (int c = 0; c < nc; c++) row[c] = a->w + (j0 + c) * a->row_bytes;
    for (int r = 0; r < mr; r++) {
        xq[r] = a->xq + (r0 + r) * a->k, xd[r] = a->xd + (r0 + r) * groups;
        for (int c = 0; c < nc; c++) acc[r][c] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        for (int c = 0; c < nc; c++) {
            gg_scales sc;
            const __m256i w = gg_group_ints(qt, row[c], g, &sc);
            const __m256i wabs = is_signed ? _mm256_sign_epi8(w, w) : w;
            if (has_min) mins[c * groups + g] = sc.min;
            const __m256 wscale = qt == GG_Q6_K ? _mm256_set_m128(_mm_set1_ps(sc.scale1),
                                                                  _mm_set1_ps(sc.scale0))
                                                : _mm256_set1_ps(sc.scale0);
            for (int r = 0; r < mr; r++) {
                const __m256i lanes = q8_lanes(
                    is_signed, w, wabs, _mm256_loadu_si256((const __m256i *)(xq[r] + g * 32)));
                const __m256 scale = _mm256_mul_ps(wscale, _mm256_broadcast_ss(xd[r] + g));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), scale, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) {
            const float m = has_min ? q8_min_term(mins + c * groups, a->xs + (r0 + r) * groups,
                                                  groups) : 0.0f;
            a->out[(r0 + r) * a->out_stride + j0 + c] = gg_hsum(acc[r][c]) + m;
        }
}

/* Constant row and column counts at each call, so the tile's loops unroll into registers. */
#define Q8_COLS(MR)                                         \
    switch (nc) {                                           \
    case 4: q8_tile(qt, a, r0, MR, j0, 4, mins); return;          \
    case 3: q8_tile(qt, a, r0, MR, j0, 3, mins); return;          \
    case 2: q8_tile(qt, a, r0, MR, j0, 2, mins); return;          \
    default: q8_tile(qt, a, r0, MR, j0, 1, mins); return;         \
    }

GG_AVX2 static GG_INLINE void q8_tile_any(const int qt, const q8_args *a, int64_t r0, int mr,
                                          int64_t j0, int nc, float *mins) {
    if (mr == 4) Q8_COLS(4)
    if (mr == 3) Q8_COLS(3)
    if (mr == 2) Q8_COLS(2)
    Q8_COLS(1)
}

/* One format's whole call (qt a literal in each instance); rows in blocks of Q8_ROW_BLOCK so
 * a block's activation bytes stay in L2 while the threads sweep their quads. Each thread's
 * mins scratch is on its stack: 16 bytes per 32 inputs. */
#define Q8_RUN(QT, NAME)                                                                    \
    GG_AVX2 static void NAME(const q8_args *a, int64_t m, int threads) {                     \
        const int64_t quads = (a->n + Q8_QUAD - 1) / Q8_QUAD;                               \
        const int nt = thread_count(threads, quads, a->row_bytes * a->n);                   \
        _Pragma("omp parallel num_threads(nt) if (nt > 1)") {                               \
            float mins[Q8_QUAD * (gg_has_min(QT) ? a->k / 32 : 1)];                         \
            for (int64_t b0 = 0; b0 < m; b0 += Q8_ROW_BLOCK) {                              \
                const int64_t b1 = m - b0 < Q8_ROW_BLOCK ? m : b0 + Q8_ROW_BLOCK;           \
                _Pragma("omp for schedule(static)")                                         \
                for (int64_t jq = 0; jq < quads; jq++) {                                    \
                    const int64_t j0 = jq * Q8_QUAD;                                        \
                    const int nc = (int)(a->n - j0 < Q8_QUAD ? a->n - j0 : Q8_QUAD);        \
                    for (int64_t r0 = b0; r0 < b1; r0 += Q8_TILE_ROWS)                      \
                        q8_tile_any(QT, a, r0,                                              \
                                    (int)(b1 - r0 < Q8_TILE_ROWS ? b1 - r0 : Q8_TILE_ROWS), \
                                    j0, nc, mins);                                          \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }
Q8_RUN(GG_Q4_0, q8_run_q4_0)
Q8_RUN(GG_Q4_1, q8_run_q4_1)
Q8_RUN(GG_Q5_0, q8_run_q5_0)
Q8_RUN(GG_Q5_1, q8_run_q5_1)
Q8_RUN(GG_Q8_0, q8_run_q8_0)
Q8_RUN(GG_Q4_K, q8_run_q4_k)
Q8_RUN(GG_Q5_K, q8_run_q5_k)
Q8_RUN(GG_Q6_K, q8_run_q6_k)
#endif

/* matmul with 8-bit activations, x fp32 [m, k]: -1 when out of memory. */
static int q8_matmul(int qt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                     const float *x, int64_t m, float *out, int64_t out_stride, int threads,
                     int avx2) {
    q8_args a = {w, row_bytes, n, k, NULL, NULL, NULL, out, out_stride};
    void *mem = q8_rows(x, m, k, avx2, &a);
    if (!mem) return -1;
    if (!avx2) q8_run_scalar(qt, &a, m, threads);
#if defined(__x86_64__)
    else switch (qt) {
    case GG_Q4_0: q8_run_q4_0(&a, m, threads); break;
    case GG_Q4_1: q8_run_q4_1(&a, m, threads); break;
    case GG_Q5_0: q8_run_q5_0(&a, m, threads); break;
    case GG_Q5_1: q8_run_q5_1(&a, m, threads); break;
    case GG_Q8_0: q8_run_q8_0(&a, m, threads); break;
    case GG_Q4_K: q8_run_q4_k(&a, m, threads); break;
    case GG_Q5_K: q8_run_q5_k(&a, m, threads); break;
    default: q8_run_q6_k(&a, m, threads); break;
    }
#endif
    free(mem);
    return 0;
}
#endif
