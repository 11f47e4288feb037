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
 * each VNNI tile prefetches a share of its thread's next panel (gemm_panels.h). Work items are
 * (panel, row block), panel-major, split statically across torch's OpenMP team, so a thread
 * reuses a panel's weights across its rows.
 * The scalar tile computes the same int32 sums; its epilogue is int8_ops.c's dequant rows and
 * the VNNI tile's register epilogue performs their float operations in the same order, so
 * results do not depend on the ISA.
 */
#ifndef KVSTRATA_INT8_GEMM_H
#define KVSTRATA_INT8_GEMM_H
#include "gemm_panels.h"

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

/* The scalar tile's view of panel p: all NR block slots filled, a short panel repeating its
 * last block (results dropped), and how many blocks (plain) or gates (silu) are real. */
static int padded_blocks(const gemm_args *g, int64_t p, int64_t blk[NR]) {
    int64_t c[NR] = {0};
    const int nr = panel_blocks(g->n, g->silu, p, c); /* >= 1 (2 for silu): p is a panel */
    if (!g->silu) {
        const int last = nr > 0 ? nr - 1 : 0;
        for (int j = 0; j < NR; j++) blk[j] = c[j < nr ? j : last];
        return nr;
    }
    const int ng = nr / 2, last = ng > 0 ? ng - 1 : 0;
    for (int j = 0; j < NR / 2; j++) {
        blk[j] = c[j < ng ? j : last];
        blk[NR / 2 + j] = c[ng + (j < ng ? j : last)];
    }
    return ng;
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
#define VNNI512 KVS_TARGET("avx512f,avx512bw,avx512vnni")
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
/* Row r's outputs from its sums c[j] over the nr blocks blk (for silu the gates, then their
 * up blocks): the epilogue of a VNNI tile's row, and of an AMX item's (int8_gemm_amx.h). */
VNNI512 static inline __attribute__((always_inline)) void row_out_vnni(
    const gemm_args *g, int64_t r, const int64_t blk[NR], const __m512i *c, const int nr) {
    const int64_t esz = g->dtype == F32 ? 4 : 2, half_n = g->n / 2;
    const __m512 xs = _mm512_set1_ps(g->xs[r]);
    if (!g->silu) {
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) {
            const int64_t c0 = blk[j] * BLOCK;
            store16(g->out + (r * g->n + c0) * esz, dequant16(c[j], g, c0, xs, c0), g->dtype);
        }
        return;
    }
#pragma GCC unroll 2
    for (int j = 0; j < nr / 2; j++) {
        const int64_t c0 = blk[j] * BLOCK, u0 = blk[nr / 2 + j] * BLOCK;
        __m512 gv = dequant16(c[j], g, c0, xs, c0);
        __m512 uv = dequant16(c[nr / 2 + j], g, u0, xs, half_n + c0);
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

/* A tile of MR rows x nr blocks (nr a compile-time constant at each call site): blk holds
 * the nr blocks, for silu the gates then their up blocks, so a short last panel computes
 * only its own columns. */
VNNI512 static inline __attribute__((always_inline)) void tile_vnni_out(
    const gemm_args *g, const uint8_t *a, int64_t r0, const int64_t blk[NR],
    prefetch_plan *pf, const int nr) {
    __m512i c[MR][NR];
    const int8_t *w[NR];
    const int64_t k = g->k;
#pragma GCC unroll 4
    for (int j = 0; j < nr; j++) w[j] = g->w + blk[j] * k * BLOCK;
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) c[i][j] = _mm512_setzero_si512();
    for (int64_t q = 0; q < k; q += 4) {
        prefetch_due(pf, q / 4);
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
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++) {
        if (r0 + i >= g->m) break;
        row_out_vnni(g, r0 + i, blk, c[i], nr);
    }
}

/* A VNNI tile takes only its panel's blocks (gates before ups), so a short last panel
 * computes only its own columns (o and down projections: 9 blocks, the last of 3 panels one). */
VNNI512 static void tile_vnni(const gemm_args *g, int64_t p, int64_t nrb, int64_t r0,
                              side_rows *side) {
    int64_t own[NR];
    const int nr = panel_blocks(g->n, g->silu, p, own);
    prefetch_plan pf = plan_next_panel((const char *)g->w, g->k * BLOCK, g->n, g->silu, p,
                                       r0 / MR, nrb);
    pf.side = side;
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

#include "int8_gemm_avx2.h"

#include "int8_gemm_amx.h"

/* What multiplies: 3 = AMX-INT8 tiles (int8_gemm_amx.h: only with cap 3, which
 * int8_linear.py passes for KVSTRATA_CPU_INT8_GEMM=amx), 2 = the VNNI tile (AVX512-VNNI),
 * 1 = the AVX2 tile (AVX2 + FMA + F16C), 0 = the scalar tile; KVSTRATA_CPU_ISA's cap
 * applies. */
static int gemm_isa(int isa_cap) {
#ifdef KVSTRATA_AMX
    if (isa_cap >= 3 && use_vnni512(isa_cap) && amx_ready(AMX_INT8_BIT)) return 3;
#endif
    if (use_vnni512(isa_cap)) return 2;
    return use_avx2(16, isa_cap) ? 1 : 0;
}

/* The tiles of one thread's share (called inside the OpenMP region, after quantisation);
 * the VNNI tiles also prefetch the thread's share of the call's side rows. */
static void gemm_tiles(const gemm_args *g, int64_t mp, int isa, const side_rows *job) {
    const int64_t nrb = mp / MR, items = panel_count(g->n, g->silu) * nrb;
    const int64_t nb_bytes = g->k * BLOCK; /* one block's packed bytes */
    side_rows side = side_of_thread(job);
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; it++) {
        const int64_t p = it / nrb, r0 = (it % nrb) * MR;
#if defined(__x86_64__)
        if (isa == 2) {
            tile_vnni(g, p, nrb, r0, side.s < side.s_end ? &side : NULL);
            continue;
        }
        if (isa == 1) { tile_avx2(g, p, nrb, r0); continue; }
#endif
        int64_t blk[NR];
        const int valid = padded_blocks(g, p, blk);
        const int8_t *w[NR];
        for (int j = 0; j < NR; j++) w[j] = g->w + blk[j] * nb_bytes;
        int32_t acc[MR][NR * BLOCK];
        tile_scalar(g->a + r0 * g->k, g->k, w, g->k, acc);
        tile_epilogue(g, acc, r0, blk, valid);
    }
    (void)isa;
}
#endif
