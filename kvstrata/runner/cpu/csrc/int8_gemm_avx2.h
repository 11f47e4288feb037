/* The AVX2 tile of kvstrata's int8 GEMM (int8_gemm.h), for CPUs without VNNI; included by
 * int8_gemm.h after its scalar and VNNI tiles.
 *
 * Why: without VNNI, `--quantization w8a8_int8` ran fbgemm's op between four torch ops a
 * linear (7-bit activations, ~100 us of fixed cost a call): a SmolLM2 decode step at batch 1
 * spent ~15 ms in its 120 int8 linears, whose 106 MB of weights stream from RAM in ~4 ms.
 *
 * vpmaddubsw multiplies u8 by s8 and adds pairs into int16, which saturates for full 8-bit
 * codes (2 * 255 * 127). The activation codes are symmetric (quant_rows: 128 + s, |s| <= 127),
 * so each product s * w is formed as |s| * (w with s's sign) (vpsignb): the pair sums stay
 * within 2 * 127 * 127 < 32767, exact, and vpmaddwd adds the pairs into int32. The sum is
 * sum(s * w) = acc - comp of the VNNI tile, the same int32, and the epilogue performs the
 * scalar dequant's float operations in the same order (silu: cpu_ops.c silu_mul's 8-lane
 * silu), so the plain outputs equal the scalar tile's bit for bit.
 *
 * A tile is MR rows x one 16-column block at a time (4 rows x 2 ymm = 8 accumulators; a
 * whole panel of 4 blocks would need 32 of the 16 registers); the panel's blocks follow one
 * another, each
 * block's k * 16 bytes read from L1 / L2 for every row block. The first block's pass
 * prefetches the thread's next panel as the VNNI tile does.
 */
#ifndef KVSTRATA_INT8_GEMM_AVX2_H
#define KVSTRATA_INT8_GEMM_AVX2_H
#if defined(__x86_64__)

/* sum(s * w) of `rows` (<= MR, a compile-time constant at each call site) rows of u8 codes a
 * (k apart) with one packed block w, into c[row][half]. */
AVX2 static inline __attribute__((always_inline)) void block_sums_avx2(
    const uint8_t *a, int64_t k, const int8_t *w, __m256i c[MR][2], prefetch_plan *pf,
    const int rows) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
#pragma GCC unroll 4
    for (int i = 0; i < rows; i++) c[i][0] = c[i][1] = _mm256_setzero_si256();
    for (int64_t q = 0; q < k; q += 4) {
        prefetch_due(pf, q / 4);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + q * 16));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + q * 16 + 32));
#pragma GCC unroll 4
        for (int i = 0; i < rows; i++) {
            int32_t quad;
            memcpy(&quad, a + i * k + q, 4);
            const __m256i s = _mm256_xor_si256(_mm256_set1_epi32(quad), flip); /* code - 128 */
            const __m256i m = _mm256_sign_epi8(s, s);                          /* |s| as u8 */
            c[i][0] = _mm256_add_epi32(c[i][0], _mm256_madd_epi16(
                _mm256_maddubs_epi16(m, _mm256_sign_epi8(w0, s)), ones));
            c[i][1] = _mm256_add_epi32(c[i][1], _mm256_madd_epi16(
                _mm256_maddubs_epi16(m, _mm256_sign_epi8(w1, s)), ones));
        }
    }
}

/* dequant_row_scalar's operations on 8 columns from c0: float(sum) * w_scale * x_scale
 * (+ bias at bias_off). */
AVX2 static inline __m256 dequant8(__m256i sum, const gemm_args *g, int64_t c0, __m256 xs,
                                   int64_t bias_off) {
    __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_loadu_ps(g->ws + c0));
    __m256 v = _mm256_mul_ps(y, xs);
    return g->bias ? _mm256_add_ps(v, _mm256_loadu_ps(g->bias + bias_off)) : v;
}
AVX2 static inline void store8(void *o, __m256 v, int dtype) {
    if (dtype == F32) _mm256_storeu_ps(o, v);
    else _mm_storeu_si128((__m128i *)o, bf16x8_from(v));
}

/* The tile of panel p at row block r0 over its `rows` real rows (a constant per call site:
 * a batch of 1-3 rows multiplies only those, not the padding up to MR). */
AVX2 static inline __attribute__((always_inline)) void tile_avx2_rows(
    const gemm_args *g, int64_t p, int64_t nrb, int64_t r0, const int rows) {
    int64_t blk[NR];
    const int nr = panel_blocks(g->n, g->silu, p, blk);
    prefetch_plan pf = plan_next_panel((const char *)g->w, g->k * BLOCK, g->n, g->silu, p,
                                       r0 / MR, nrb);
    const uint8_t *a = g->a + r0 * g->k;
    const int64_t k = g->k, esz = g->dtype == F32 ? 4 : 2, half_n = g->n / 2;
    if (!g->silu) {
        for (int j = 0; j < nr; j++) {
            __m256i c[MR][2];
            block_sums_avx2(a, k, g->w + blk[j] * k * BLOCK, c, &pf, rows);
            for (int i = 0; i < rows; i++) {
                const int64_t r = r0 + i;
                const __m256 xs = _mm256_set1_ps(g->xs[r]);
                for (int h = 0; h < 2; h++) {
                    const int64_t c0 = blk[j] * BLOCK + 8 * h;
                    store8(g->out + (r * g->n + c0) * esz, dequant8(c[i][h], g, c0, xs, c0),
                           g->dtype);
                }
            }
        }
        return;
    }
    for (int j = 0; j < nr / 2; j++) { /* gate block j, then its up block */
        __m256i cg[MR][2], cu[MR][2];
        block_sums_avx2(a, k, g->w + blk[j] * k * BLOCK, cg, &pf, rows);
        block_sums_avx2(a, k, g->w + blk[nr / 2 + j] * k * BLOCK, cu, &pf, rows);
        for (int i = 0; i < rows; i++) {
            const int64_t r = r0 + i;
            const __m256 xs = _mm256_set1_ps(g->xs[r]);
            for (int h = 0; h < 2; h++) {
                const int64_t c0 = blk[j] * BLOCK + 8 * h, u0 = blk[nr / 2 + j] * BLOCK + 8 * h;
                __m256 gv = dequant8(cg[i][h], g, c0, xs, c0);
                __m256 uv = dequant8(cu[i][h], g, u0, xs, half_n + c0);
                void *o = g->out + (r * half_n + c0) * esz;
                if (g->dtype == F32) {
                    _mm256_storeu_ps(o, _mm256_mul_ps(silu_v8(gv), uv));
                } else {
                    __m256 act = bf16x8_round(silu_v8(bf16x8_round(gv)));
                    _mm_storeu_si128((__m128i *)o,
                                     bf16x8_from(_mm256_mul_ps(act, bf16x8_round(uv))));
                }
            }
        }
    }
}

AVX2 static void tile_avx2(const gemm_args *g, int64_t p, int64_t nrb, int64_t r0) {
    switch (g->m - r0 < MR ? (int)(g->m - r0) : MR) {
    case 1: tile_avx2_rows(g, p, nrb, r0, 1); return;
    case 2: tile_avx2_rows(g, p, nrb, r0, 2); return;
    case 3: tile_avx2_rows(g, p, nrb, r0, 3); return;
    default: tile_avx2_rows(g, p, nrb, r0, MR); return;
    }
}
#endif
#endif
