/* gguf_ops.c's matmul with 8-bit activations (gguf_q8_blocks.h: the scheme and why it is
 * batch-invariant): x's rows quantized once per call into q8_rows, then the output columns in
 * quads, in chunks for kvstrata's worker threads (gguf_pool.h) or torch's OpenMP team, each
 * output computed whole by one thread.
 * Inside a quad, rows in tiles of up to Q8_TILE_ROWS (4; 2 and 3 measured no faster): each
 * weight group is unpacked once per tile and dotted with every row of the tile (the packed
 * quad stays in L1 across the tiles). Per group and row the float work (convert, scale
 * product, FMA) is what bounds it at many rows: at 32 rows it runs ~0.6x gguf_ops.c's float
 * panels, whose 3 x 4 FMA tiles need no per-group scale (docs/benchmarks.md). */
#ifndef KVSTRATA_GGUF_Q8_RUN_H
#define KVSTRATA_GGUF_Q8_RUN_H
#include <stdlib.h>
#include "cpu_rows.h"
#include "gguf_pool.h"
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

typedef struct { /* one call's work for the pool: chunks of quads x row blocks */
    const q8_args *a;
    pool_grid grid;
} q8_job;

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
/* The tiles and calls, once per instruction set (gguf_q8_tiles.h): AVX2, and AVX-512 VNNI
 * (vpdpbusd: one instruction for the AVX2 body's vpmaddubsw + vpmaddwd, the same exact sums). */
#define Q8_TARGET GG_AVX2
#define Q8_FN(name) name##_avx2
#define Q8_LANES q8_lanes
#include "gguf_q8_tiles.h"
#undef Q8_TARGET
#undef Q8_FN
#undef Q8_LANES
#define Q8_TARGET GG_VNNI
#define Q8_FN(name) name##_vnni
#define Q8_LANES q8_lanes_vnni
#include "gguf_q8_tiles.h"
#undef Q8_TARGET
#undef Q8_FN
#undef Q8_LANES
#endif

/* matmul with 8-bit activations, x fp32 [m, k] (vnni: the AVX-512 VNNI body, with avx2 set):
 * -1 when out of memory. */
static int q8_matmul(int qt, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                     const float *x, int64_t m, float *out, int64_t out_stride, int threads,
                     int avx2, int vnni) {
    q8_args a = {w, row_bytes, n, k, NULL, NULL, NULL, out, out_stride};
    void *mem = q8_rows(x, m, k, avx2, &a);
    if (!mem) return -1;
    if (!avx2) q8_run_scalar(qt, &a, m, threads);
#if defined(__x86_64__)
    else if (vnni) q8_run_vnni(qt, &a, m, threads);
    else q8_run_avx2(qt, &a, m, threads);
#endif
    free(mem);
    return 0;
}
#endif
