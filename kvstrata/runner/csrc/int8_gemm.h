/* kvstrata's own int8 linear for `--quantization w8a8_int8` on an AVX512-VNNI CPU, included
 * by int8_ops.c (which provides the row quantisers and the float epilogue's helpers).
 *
 * Why: a decode step makes ~121 int8 linears of 1-64 rows; through oneDNN each was three
 * calls (quantise, `onednn::qlinear_pointwise`, dequantise), ~40 us of fixed cost apiece,
 * with the GEMM itself at ~40% of the VNNI peak at 32 rows. Here one call quantises the rows,
 * multiplies and writes the model's dtype (and, for a fused gate|up projection, silu(g) * u).
 *
 * Weight layout (int8_linear.py pack_vnni): the [n, k] int8 codes as n / 16 blocks of 16
 * output columns, each [k / 4][16][4]: for 4 consecutive k, the 16 columns' 4 codes side by
 * side -- one 64-byte load is what vpdpbusd multiplies with a broadcast u8 quadruple of a row.
 * Activations are the u8 codes quant_rows writes (zero point 128), so each column's sum is
 * acc - 128 * colsum(w) (comp[j] = 128 * colsum, precomputed).
 *
 * Tiles: MR rows x NR blocks (4 x 64 columns, 16 zmm accumulators). Rows are padded to a
 * multiple of MR (the padding rows are code 128, results dropped); the last panel's VNNI tile is
 * as narrow as its blocks (the scalar tile repeats a valid block instead, results dropped), and
 * each VNNI tile prefetches a share of its thread's next panel. Work items are (panel, row block), panel-major, split
 * statically across torch's OpenMP team, so a thread reuses a panel's weights across its rows.
 * The scalar tile computes the same int32 sums; its epilogue is int8_ops.c's dequant rows and
 * the VNNI tile's register epilogue performs their float operations in the same order, so
 * results do not depend on the ISA.
 */
#ifndef KVSTRATA_INT8_GEMM_H
#define KVSTRATA_INT8_GEMM_H

#define MR 4
#define NR 4
#define BLOCK 16 /* output columns per block (one zmm of int32) */

typedef struct {
    const uint8_t *a;    /* [mp, k] u8 codes */
    const float *xs;     /* [mp] token scales */
    const int8_t *w;     /* packed blocks */
    const int32_t *comp; /* [n] 128 * colsum */
    const float *ws;     /* [n] weight scales */
    const float *bias;   /* [n] or NULL */
    char *out;           /* [m, n] or [m, n / 2] (silu) in dtype */
    int64_t m, k, n;
    int dtype, silu;
} gemm_args;

/* The NR block indices of panel p and how many of them (plain) or of the gates (silu) are
 * real: plain panels are NR consecutive blocks; silu panels pair NR / 2 gate blocks with the
 * up blocks of the same columns (the up half starts at block nb / 2). */
static int panel_blocks(const gemm_args *g, int64_t p, int64_t blk[NR]) {
    const int64_t nb = g->n / BLOCK;
    if (!g->silu) {
        for (int j = 0; j < NR; j++) blk[j] = p * NR + j < nb ? p * NR + j : nb - 1;
        return (int)(nb - p * NR < NR ? nb - p * NR : NR);
    }
    const int64_t half = nb / 2, per = NR / 2;
    for (int j = 0; j < per; j++) {
        blk[j] = p * per + j < half ? p * per + j : half - 1;
        blk[per + j] = half + blk[j];
    }
    return (int)(half - p * per < per ? half - p * per : per);
}

static int64_t panel_count(const gemm_args *g) {
    const int64_t nb = g->n / BLOCK, per = g->silu ? NR / 2 : NR;
    return g->silu ? (nb / 2 + per - 1) / per : (nb + per - 1) / per;
}

static void tile_scalar(const uint8_t *a, int64_t lda, const int8_t *const w[NR], int64_t k,
                        int32_t acc[MR][NR * BLOCK]) {
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++)
            for (int c = 0; c < BLOCK; c++) {
                int32_t s = 0;
                for (int64_t q = 0; q < k; q++)
                    s += (int32_t)a[i * lda + q] * (int32_t)w[j][(q / 4) * 64 + c * 4 + q % 4];
                acc[i][j * BLOCK + c] = s;
            }
}

#if defined(__x86_64__)
#define VNNI512 __attribute__((target("avx512f,avx512bw,avx512vnni")))
/* The AVX-512 epilogue straight from a tile's registers: per block the operations of
 * block_to_float_avx512 then dequant_row_avx512 (plain) or dequant_silu_row_avx512 (silu), in
 * the same order, so the values equal the generic path's; without the round trip through the
 * int32 tile in memory and 16 calls per tile. Measured (bench_int8_gemm.py, one box): 2048
 * rows 1.00x -> 1.25x oneDNN's time; 32 rows within the noise (7.6-9.0 vs 7.8 ms). */
VNNI512 static inline __m512 dequant16(__m512i acc, const gemm_args *g, int64_t c0, __m512 xs,
                                       int64_t bias_off) {
    __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(
                                 acc, _mm512_loadu_si512((const void *)(g->comp + c0)))),
                             _mm512_loadu_ps(g->ws + c0));
    __m512 v = _mm512_mul_ps(y, xs);
    return g->bias ? _mm512_add_ps(v, _mm512_loadu_ps(g->bias + bias_off)) : v;
}
VNNI512 static inline void store16(void *o, __m512 v, int dtype) {
    if (dtype == F32) _mm512_storeu_ps(o, v);
    else _mm256_storeu_si256((__m256i *)o, bf16x16_from(v));
}
/* What a tile prefetches of the panel its thread multiplies next (as bf16_gemm.c does): row
 * block rb of nrb takes every nrb-th 64-byte line of the panel's blocks, one per k step, so
 * that panel streams in from RAM while this one's rows multiply from cache. Measured: the 120
 * GEMMs of a decode step at 32 rows 7.6-7.9 -> 6.3-6.9 ms (with the narrower tail tiles
 * below; o and down have 9 blocks of 16 columns, so their last panel computed 4 for 1). */
typedef struct {
    const int8_t *w[NR];
    int nr;
    int64_t first, every;
} prefetch_plan;

/* A tile of MR rows x nr blocks (nr a compile-time constant at each call site): blk holds
 * the nr blocks, for silu the gates then their up blocks, so a short last panel computes
 * only its own columns. */
VNNI512 static inline __attribute__((always_inline)) void tile_vnni_out(
    const gemm_args *g, const uint8_t *a, int64_t r0, const int64_t blk[NR],
    const prefetch_plan *pf, const int nr) {
    __m512i c[MR][NR];
    const int8_t *w[NR];
    const int64_t k = g->k;
#pragma GCC unroll 4
    for (int j = 0; j < nr; j++) w[j] = g->w + blk[j] * k * BLOCK;
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) c[i][j] = _mm512_setzero_si512();
    int64_t next_line = pf->nr ? pf->first : k; /* the k step whose line is prefetched */
    for (int64_t q = 0; q < k; q += 4) {
        if (q / 4 == next_line) {
            for (int j = 0; j < pf->nr; j++)
                _mm_prefetch((const char *)(pf->w[j] + q * BLOCK), _MM_HINT_T1);
            next_line += pf->every;
        }
        __m512i b[NR];
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) b[j] = _mm512_loadu_si512((const void *)(w[j] + q * 16));
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            int32_t quad;
            memcpy(&quad, a + i * k + q, 4);
            const __m512i av = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
            for (int j = 0; j < nr; j++) c[i][j] = _mm512_dpbusd_epi32(c[i][j], av, b[j]);
        }
    }
    const int64_t esz = g->dtype == F32 ? 4 : 2, half_n = g->n / 2;
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) {
        const int64_t r = r0 + i;
        if (r >= g->m) break;
        const __m512 xs = _mm512_set1_ps(g->xs[r]);
        if (!g->silu) {
#pragma GCC unroll 4
            for (int j = 0; j < nr; j++) {
                const int64_t c0 = blk[j] * BLOCK;
                store16(g->out + (r * g->n + c0) * esz, dequant16(c[i][j], g, c0, xs, c0),
                        g->dtype);
            }
            continue;
        }
#pragma GCC unroll 2
        for (int j = 0; j < nr / 2; j++) {
            const int64_t c0 = blk[j] * BLOCK, u0 = blk[nr / 2 + j] * BLOCK;
            __m512 gv = dequant16(c[i][j], g, c0, xs, c0);
            __m512 uv = dequant16(c[i][nr / 2 + j], g, u0, xs, half_n + c0);
            void *o = g->out + (r * half_n + c0) * esz;
            if (g->dtype == F32) {
                _mm512_storeu_ps(o, _mm512_mul_ps(silu_v(gv), uv));
            } else {
                __m512 act = bf16x16_round(silu_v(bf16x16_round(gv)));
                _mm256_storeu_si256((__m256i *)o,
                                    bf16x16_from(_mm512_mul_ps(act, bf16x16_round(uv))));
            }
        }
    }
}

/* The valid blocks of a panel as tile_vnni_out takes them: how many, gates before ups. */
static int compact_blocks(const gemm_args *g, const int64_t blk[NR], int valid, int64_t out[NR]) {
    for (int j = 0; j < valid; j++) {
        out[j] = blk[j];
        if (g->silu) out[valid + j] = blk[NR / 2 + j];
    }
    return g->silu ? 2 * valid : valid;
}

VNNI512 static void tile_vnni(const gemm_args *g, int64_t p, int64_t nrb, int64_t r0) {
    int64_t blk[NR], own[NR];
    const int nr = compact_blocks(g, blk, panel_blocks(g, p, blk), own);
    prefetch_plan pf = {{NULL}, 0, r0 / MR, nrb};
    if (p + 1 < panel_count(g)) {
        int64_t nblk[NR], next[NR];
        pf.nr = compact_blocks(g, nblk, panel_blocks(g, p + 1, nblk), next);
        for (int j = 0; j < pf.nr; j++) pf.w[j] = g->w + next[j] * g->k * BLOCK;
    }
    const uint8_t *a = g->a + r0 * g->k;
    switch (nr) {
    case 4: tile_vnni_out(g, a, r0, own, &pf, 4); return;
    case 3: tile_vnni_out(g, a, r0, own, &pf, 3); return;
    case 2: tile_vnni_out(g, a, r0, own, &pf, 2); return;
    default: tile_vnni_out(g, a, r0, own, &pf, 1); return;
    }
}
#endif

/* float(acc - comp) * w_scale for the 16 columns of block `blk` (what oneDNN's int8 linear
 * returned to dequant_rows: one rounding of the exact int32 sum, one of the product). */
static void block_to_float(const gemm_args *g, const int32_t *acc, int64_t blk, float y[BLOCK]) {
    const int64_t c0 = blk * BLOCK;
    for (int c = 0; c < BLOCK; c++) y[c] = (float)(acc[c] - g->comp[c0 + c]) * g->ws[c0 + c];
}

/* The scalar tile's epilogue: int8_ops.c's scalar dequant rows over each 16-column block. */
static void tile_epilogue(const gemm_args *g, int32_t acc[MR][NR * BLOCK], int64_t r0,
                          const int64_t blk[NR], int valid) {
    const int64_t esz = g->dtype == F32 ? 4 : 2, half_n = g->n / 2;
    for (int i = 0; i < MR && r0 + i < g->m; i++) {
        const int64_t r = r0 + i;
        const float xs = g->xs[r];
        for (int j = 0; j < valid; j++) {
            const int64_t c0 = blk[j] * BLOCK;
            if (!g->silu) {
                float y[BLOCK];
                block_to_float(g, acc[i] + j * BLOCK, blk[j], y);
                dequant_row_scalar(y, BLOCK, xs, g->bias ? g->bias + c0 : NULL,
                                   g->out + (r * g->n + c0) * esz, g->dtype);
                continue;
            }
            /* gate block j and its up block NR/2 + j, laid out as dequant_silu's [g | u] row */
            float y[2 * BLOCK], b[2 * BLOCK];
            block_to_float(g, acc[i] + j * BLOCK, blk[j], y);
            block_to_float(g, acc[i] + (NR / 2 + j) * BLOCK, blk[NR / 2 + j], y + BLOCK);
            if (g->bias) {
                memcpy(b, g->bias + c0, sizeof(float) * BLOCK);
                memcpy(b + BLOCK, g->bias + half_n + c0, sizeof(float) * BLOCK);
            }
            dequant_silu_row_scalar(y, BLOCK, xs, g->bias ? b : NULL,
                                    g->out + (r * half_n + c0) * esz, g->dtype);
        }
    }
}

static int use_vnni512(int isa_cap) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return isa_cap >= 2 && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bw");
#else
    (void)isa_cap;
    return 0;
#endif
}

/* The tiles of one thread's share (called inside the OpenMP region, after quantisation). */
static void gemm_tiles(const gemm_args *g, int64_t mp, int vnni) {
    const int64_t nrb = mp / MR, items = panel_count(g) * nrb;
    const int64_t nb_bytes = g->k * BLOCK; /* one block's packed bytes */
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; it++) {
        const int64_t p = it / nrb, r0 = (it % nrb) * MR;
#if defined(__x86_64__)
        if (vnni) { tile_vnni(g, p, nrb, r0); continue; }
#endif
        int64_t blk[NR];
        const int valid = panel_blocks(g, p, blk);
        const int8_t *w[NR];
        for (int j = 0; j < NR; j++) w[j] = g->w + blk[j] * nb_bytes;
        int32_t acc[MR][NR * BLOCK];
        tile_scalar(g->a + r0 * g->k, g->k, w, g->k, acc);
        tile_epilogue(g, acc, r0, blk, valid);
    }
    (void)vnni;
}
#endif
