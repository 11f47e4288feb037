/* bf16_gemm.c's body on AMX-BF16 (Sapphire / Emerald / Granite Rapids Xeons): the same
 * packed weights, the same epilogue, its products on the tile registers.
 *
 * Why: on 16 cores of an H200 host's Emerald Rapids (AMX, 2026-12-04) the AVX512-BF16 tiles
 * ran a decode step's GEMMs at 32 rows in 15.9 ms (427 GFLOP/s) and oneDNN's AMX kernels in
 * 10.6 ms, while both sat far below what the tiles do: one tdpbf16ps is 16 x 16 x 32
 * multiply-adds, 16x a vdpbf16ps. At decode's 1-64 rows the weights' stream and the per-call
 * cost set the pace, so the item is small: up to 32 rows (two A tiles) x 32 columns (two
 * blocks), 8 tile registers, one configuration (every tile 16 rows x 64 bytes) per call.
 *
 * Rows: A tiles read x in place, 16 rows at a time; the last 1-15 rows (m % 16) are copied
 * once per call into a zeroed 16-row buffer, so no tile reads past x and every tile keeps
 * the one configuration (the padding rows' sums are never stored). k % 32 == 0 (SmolLM2's
 * 576 and 1536; bf16_gemm.c sends other k, and calls of up to 4 rows, to the AVX512-BF16
 * tiles). Panels of two blocks (silu: gate block p and its up block), work items (panel,
 * 32-row block) panel-major over torch's OpenMP team as the other bodies' (the tiles' setup,
 * the item and its emulation: amx_tiles.h, amx_item.h). Where Linux refuses the tiles, the
 * AVX512-BF16 tiles run.
 *
 * Numbers: products of bf16 pairs are exact in fp32 and summed in fp32, as vdpbf16ps does
 * (in another order), then the AVX-512 epilogue rounds once, so results sit within the same
 * bound of exact as the other bodies' (tests/correctness/test_bf16_gemm.py). The emulated
 * tiles (amx_item_emu, with the AVX2 epilogue or, on AVX512-BF16, this one) are for those
 * tests on CPUs without AMX. */
#ifndef KVSTRATA_BF16_GEMM_AMX_H
#define KVSTRATA_BF16_GEMM_AMX_H
#include "amx_tiles.h"
#ifdef KVSTRATA_AMX
#define AMX_K 32 /* k per tile step: 32 bf16 (16 pairs) of a row */

/* tdpbf16ps as its definition reads: per row and column, each k pair's two exact products
 * added in turn. */
static void emu_dp_bf16(int c, int a, int b) {
    for (int m = 0; m < AMX_ROWS; m++)
        for (int n = 0; n < 16; n++) {
            float acc, x0, x1, w0, w1;
            uint16_t h[2], v[2];
            memcpy(&acc, &emu_tmm[c][m][4 * n], 4);
            for (int kk = 0; kk < 16; kk++) {
                memcpy(h, &emu_tmm[a][m][4 * kk], 4);
                memcpy(v, &emu_tmm[b][kk][4 * n], 4);
                x0 = bf16_to_f32(h[0]), x1 = bf16_to_f32(h[1]);
                w0 = bf16_to_f32(v[0]), w1 = bf16_to_f32(v[1]);
                acc += x0 * w0;
                acc += x1 * w1;
            }
            memcpy(&emu_tmm[c][m][4 * n], &acc, 4);
        }
}

#define AMX_A_T uint16_t
#define AMX_W_T uint16_t
#define AMX_ACC_T float
#define TDP_HW(c, a, b) _tile_dpbf16ps(c, a, b)
#define TDP_EMU(c, a, b) emu_dp_bf16(c, a, b)
#include "amx_item.h"

/* The item's sums (acc) + bias, rounded once, stored as tile() stores its registers. */
BF16_512 static void amx_store_512(const gemm_args *g, int64_t r0, int rows,
                                   const int64_t blk[2], int nb, const float *acc) {
    const int64_t half_n = g->n / 2;
    for (int i = 0; i < rows; i++) {
        const int64_t r = r0 + i;
        const float *a = acc + i * 2 * BLOCK;
        if (g->silu) {
            const int64_t c0 = blk[0] * BLOCK;
            const __m512 gv = bf16x16_round(add_bias(_mm512_loadu_ps(a), g->bias, c0));
            const __m512 uv =
                bf16x16_round(add_bias(_mm512_loadu_ps(a + BLOCK), g->bias, half_n + c0));
            const __m512 act = bf16x16_round(silu_v(gv));
            _mm256_storeu_si256((__m256i *)((uint16_t *)g->out + r * half_n + c0),
                                bf16x16_from(_mm512_mul_ps(act, uv)));
            continue;
        }
        for (int j = 0; j < nb; j++) {
            const int64_t c0 = blk[j] * BLOCK;
            const __m512 v = add_bias(_mm512_loadu_ps(a + j * BLOCK), g->bias, c0);
            if (g->f32_out)
                _mm512_storeu_ps((float *)g->out + r * g->n + c0, bf16x16_round(v));
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)g->out + r * g->n + c0),
                                    bf16x16_from(v));
        }
    }
}

/* The same at AVX2 width (the emulated tiles' epilogue; silu_v8 as tile_avx2's). */
AVX2 static void amx_store_avx2(const gemm_args *g, int64_t r0, int rows, const int64_t blk[2],
                                int nb, const float *acc) {
    const int64_t half_n = g->n / 2;
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < 2; h++) {
            const int64_t r = r0 + i;
            const float *a = acc + i * 2 * BLOCK + 8 * h;
            if (g->silu) {
                const int64_t c0 = blk[0] * BLOCK + 8 * h;
                const __m256 gv = rounded8(_mm256_loadu_ps(a), g->bias, c0);
                const __m256 uv = rounded8(_mm256_loadu_ps(a + BLOCK), g->bias, half_n + c0);
                const __m256 act = bf16x8_round(silu_v8(gv));
                _mm_storeu_si128((__m128i *)((uint16_t *)g->out + r * half_n + c0),
                                 bf16x8_from(_mm256_mul_ps(act, uv)));
                continue;
            }
            for (int j = 0; j < nb; j++) {
                const int64_t c0 = blk[j] * BLOCK + 8 * h, at = r * g->n + c0;
                const __m256 v = rounded8(_mm256_loadu_ps(a + j * BLOCK), g->bias, c0);
                if (g->f32_out)
                    _mm256_storeu_ps((float *)g->out + at, v);
                else
                    _mm_storeu_si128((__m128i *)((uint16_t *)g->out + at), bf16x8_from(v));
            }
        }
}

/* The whole linear on the tiles (mode: amx_tiles.h's AMX_HW, or emulated in memory with
 * the AVX2 epilogue, AMX_EMU, or the tiles' own AVX-512 one, AMX_EMU_512). Returns -1 when
 * out of memory. */
static int amx_linear(const gemm_args *g, int threads, int mode) {
    const int emulate = mode != AMX_HW;
    const int64_t m = g->m, k = g->k, full = m / AMX_ROWS * AMX_ROWS;
    uint16_t *pad = NULL; /* rows full .. m, zero below them */
    if (full < m) {
        pad = calloc((size_t)AMX_ROWS * k, 2);
        if (!pad) return -1;
        for (int64_t r = full; r < m; r++)
            memcpy(pad + (r - full) * k, g->x + r * g->stride, (size_t)k * 2);
    }
    const int64_t nrb = (m + AMX_ITEM_ROWS - 1) / AMX_ITEM_ROWS;
    const int64_t items = amx_panel_count(g->n, g->silu) * nrb;
    const int nt = thread_count(threads, items, g->n * k * 2);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float acc[AMX_ITEM_ROWS * 2 * BLOCK] __attribute__((aligned(64)));
        if (!emulate) amx_configure();
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            int64_t r0, blk[2];
            int nb;
            const int valid = amx_item_at(it, nrb, m, g->n, g->silu, &r0, blk, &nb);
            /* a tile's rows: in place when all 16 are x's, else the padded copy */
            const uint16_t *a0 = r0 < full ? g->x + r0 * g->stride : pad;
            const int64_t s0 = (r0 < full ? g->stride : k) * 2;
            const uint16_t *a1 = NULL;
            int64_t s1 = 0;
            if (valid > AMX_ROWS) {
                a1 = r0 + AMX_ROWS < full ? g->x + (r0 + AMX_ROWS) * g->stride : pad;
                s1 = (r0 + AMX_ROWS < full ? g->stride : k) * 2;
            }
            if (emulate) amx_item_emu(a0, s0, a1, s1, g->w, blk, nb, k, acc);
            else amx_item_hw(a0, s0, a1, s1, g->w, blk, nb, k, acc);
            if (mode == AMX_EMU) amx_store_avx2(g, r0, valid, blk, nb, acc);
            else amx_store_512(g, r0, valid, blk, nb, acc);
        }
        if (!emulate) amx_release();
    }
    Py_END_ALLOW_THREADS
    free(pad);
    return 0;
}
#endif
#endif
