/* bf16_gemm.c's body for a CPU whose bf16 has no instructions of its own: AVX2 + FMA (the
 * AVX2-only machines; also any CPU with KVSTRATA_CPU_ISA=avx2).
 *
 * Why: torch's bf16 F.linear has no vector kernel there (oneDNN's bf16 needs AVX-512): at
 * SmolLM2's shapes on a 2-vCPU AVX2 EPYC it ran 17-18 GFLOP/s where fp32 ran 98-143, so a
 * bf16 model (--dtype bfloat16, or the suite's bf16 tests) ran ~6x slower than fp32.
 *
 * How: the same packed weights and work items as the AVX512-BF16 tiles. Each 32-bit lane of a
 * packed block holds one column's pair of bf16 weights (k even in the low half), so one shift
 * widens the even k to fp32 and one mask the odd k; the item's rows are widened once into a
 * per-thread buffer and broadcast from it (with many row blocks the panel's weights too:
 * WIDEN_MIN_ROW_BLOCKS). The products of two bf16 values are exact in fp32
 * and summed in fp32, as vdpbf16ps does (in another order). A tile is up to MR_AVX2 rows x
 * one block of 16 columns (12 ymm accumulators); the panel's blocks run one after the other, its
 * gate|up pairs (silu) one pair at a time, and the epilogue rounds as the AVX-512 one does
 * (silu through silu_v8, which cpu_ops.c's AVX2 silu_mul shares: the fused and the two-step
 * results are equal). Included by bf16_gemm.c after gemm_args and ALWAYS_INLINE. */
#ifndef KVSTRATA_BF16_GEMM_AVX2_H
#define KVSTRATA_BF16_GEMM_AVX2_H
#if defined(__x86_64__)
#include <stdlib.h>

/* Rows per tile: 6 x 2 ymm = 12 accumulators, each taking two dependent FMAs per pair of k
 * (24 FMAs = 12 cycles at two a cycle, while one chain's two take 8): at 4 rows the chains'
 * latency, not the FMA ports, set the pace (74-78 GFLOP/s at 32-256 rows). */
#define MR_AVX2 6

/* Up to two row blocks (12 rows: a decode step at a small batch), each panel is read once or
 * twice and the weights' stream sets the pace. There the plan of the next panel (a burst of
 * its lines while this panel's first block multiplies) left the tile waiting on its own
 * loads (~10 GB/s of weights at one row); each block prefetching its own stream
 * STREAM_AHEAD k pairs (1 KiB) on instead took SmolLM2's 120 layer linears at 1 row 13.3-16.8
 * -> 10.3-14.6 ms, 2-4 rows 1.2-1.6x, 8-12 rows 1.0-1.3x (benchmarks/bench_gemm.py --kind
 * bf16, 2 threads, builds alternated; bit-equal results). From three row blocks on the plan
 * stays (at 32 rows it took the same GEMMs 16.1 -> 12.1 ms when it came). */
#define STREAM_MAX_ROW_BLOCKS 2
#define STREAM_AHEAD 16

/* From this many row blocks on (25+ rows), a thread widens each panel it takes to fp32 once
 * (widen_panel_avx2, a buffer of NR x k x 16 floats: 384 KiB at k = 1536) and its tiles read
 * the floats: the shift and mask per k pair run once a panel, not once a row block, and the
 * results are the same bit for bit. benchmarks/bench_gemm.py --kind bf16 (SmolLM2's layer
 * shapes, 2 threads), builds alternated: 2048 rows 944-1358 -> 660-943 ms (1.43x), 512 rows
 * 1.05-1.45x, 128 rows 1.2-1.4x, 32 rows 1.15-1.2x; at 3 row blocks no change, at 4 mixed. */
#ifndef WIDEN_MIN_ROW_BLOCKS
#define WIDEN_MIN_ROW_BLOCKS 5
#endif

/* mr rows x one block: acc[i][0] gets columns 0-7 of row i, acc[i][1] columns 8-15. The sums
 * live in locals until the end (through `acc` the compiler stored them at every k: xf might
 * alias it). */
AVX2 static ALWAYS_INLINE void block_avx2(const float *xf, int64_t xs, int64_t k,
                                          const uint16_t *w, const float *wf,
                                          prefetch_plan *pf, __m256 acc[MR_AVX2][2],
                                          const int mr, const int f32w) {
    /* wf (a literal NULL or not in each caller, so the branches fold away): the block's
     * weights widened beforehand (widen_panel_avx2), each k step's 16 floats; else w's
     * packed pairs, widened here. The FMAs are the same, in the same order. xs: the rows'
     * stride. f32w (a literal): wf is an fp32 model's own weights (tile_f32_avx2), which the
     * plan prefetches too, a 64-byte line per k step where packed bf16 has one per pair. */
    const __m256i odd_mask = _mm256_set1_epi32((int)0xffff0000u);
    __m256 c[MR_AVX2][2];
    const int64_t ahead = pf->ahead * BLOCK * 2; /* in uint16_t */
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int64_t q = 0; q < k; q += 2) {
        if (f32w) {
            prefetch_due(pf, q);
            prefetch_due(pf, q + 1);
        } else {
            prefetch_due(pf, q / 2);
        }
        __m256i w0 = _mm256_setzero_si256(), w1 = _mm256_setzero_si256();
        __m256 e0, e1, o0, o1;
        if (wf) {
            e0 = _mm256_loadu_ps(wf + q * BLOCK);
            e1 = _mm256_loadu_ps(wf + q * BLOCK + 8);
        } else {
            if (ahead) /* past the block's end too: a prefetch never faults */
                __builtin_prefetch(w + q * BLOCK + ahead, 0, 0);
            w0 = _mm256_loadu_si256((const __m256i *)(w + q * BLOCK));
            w1 = _mm256_loadu_si256((const __m256i *)(w + q * BLOCK + 16));
            e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
            e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
        }
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_broadcast_ss(xf + i * xs + q);
            c[i][0] = _mm256_fmadd_ps(a, e0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(a, e1, c[i][1]);
        }
        if (wf) {
            o0 = _mm256_loadu_ps(wf + (q + 1) * BLOCK);
            o1 = _mm256_loadu_ps(wf + (q + 1) * BLOCK + 8);
        } else {
            o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, odd_mask));
            o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, odd_mask));
        }
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            const __m256 a = _mm256_broadcast_ss(xf + i * xs + q + 1);
            c[i][0] = _mm256_fmadd_ps(a, o0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(a, o1, c[i][1]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) {
        acc[i][0] = c[i][0];
        acc[i][1] = c[i][1];
    }
}

/* The nr blocks blk[] of a panel widened to fp32 into wf ([nr][k][16]): each k step's 16
 * weights as floats, so the tiles of the panel's many row blocks skip the shift and mask. */
AVX2 static void widen_panel_avx2(const uint16_t *w, int64_t k, const int64_t blk[NR], int nr,
                                  float *wf) {
    const __m256i odd_mask = _mm256_set1_epi32((int)0xffff0000u);
    for (int j = 0; j < nr; j++) {
        const uint16_t *b = w + blk[j] * k * BLOCK;
        float *o = wf + j * k * BLOCK;
        for (int64_t q = 0; q < k; q += 2)
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + q * BLOCK + 16 * h));
                _mm256_storeu_ps(o + q * BLOCK + 8 * h,
                                 _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
                _mm256_storeu_ps(o + (q + 1) * BLOCK + 8 * h,
                                 _mm256_castsi256_ps(_mm256_and_si256(v, odd_mask)));
            }
    }
}

/* One block for mr rows: from wf (the widened panel's block) when given, else from w. */
AVX2 static void block_any_avx2(const float *xf, int64_t xs, int64_t k, const uint16_t *w,
                                const float *wf, prefetch_plan *pf, __m256 acc[MR_AVX2][2],
                                int mr, int f32w) {
#define BLOCK_ROWS(M)                                                                     \
    do {                                                                                  \
        if (f32w) block_avx2(xf, xs, k, NULL, wf, pf, acc, M, 1);                         \
        else if (wf) block_avx2(xf, xs, k, NULL, wf, pf, acc, M, 0);                      \
        else block_avx2(xf, xs, k, w, NULL, pf, acc, M, 0);                               \
        return;                                                                           \
    } while (0)
    switch (mr) {
    case 6: BLOCK_ROWS(6);
    case 5: BLOCK_ROWS(5);
    case 4: BLOCK_ROWS(4);
    case 3: BLOCK_ROWS(3);
    case 2: BLOCK_ROWS(2);
    default: BLOCK_ROWS(1);
    }
#undef BLOCK_ROWS
}

/* acc + bias, rounded to bf16 (as fp32 values). */
AVX2 static inline __m256 rounded8(__m256 v, const float *bias, int64_t c0) {
    return bf16x8_round(bias ? _mm256_add_ps(v, _mm256_loadu_ps(bias + c0)) : v);
}

/* One work item: rows r0 .. r0 + mr of the panel whose blocks are blk[0 .. nr); xf: this
 * thread's buffer of MR_AVX2 * k floats; wf: the panel widened (widen_panel_avx2), or NULL. */
AVX2 static void tile_avx2(const gemm_args *g, int64_t r0, const int64_t blk[NR],
                           prefetch_plan *pf, int mr, int nr, float *xf, const float *wf) {
    const int64_t k = g->k, half_n = g->n / 2;
    for (int i = 0; i < mr; i++) {
        const uint16_t *a = g->x + (r0 + i) * g->stride;
        for (int64_t q = 0; q < k; q += 8) { /* k % 2 == 0: the last step may widen 2-6 */
            if (k - q >= 8) { _mm256_storeu_ps(xf + i * k + q, bf16x8_load(a + q)); continue; }
            for (int64_t t = q; t < k; t++) xf[i * k + t] = bf16_to_f32(a[t]);
        }
    }
    __m256 acc[MR_AVX2][2], up[MR_AVX2][2];
    const int blocks = g->silu ? nr / 2 : nr;
    for (int j = 0; j < blocks; j++) {
        const int64_t c0 = blk[j] * BLOCK;
        block_any_avx2(xf, k, k, g->w + blk[j] * k * BLOCK, wf ? wf + j * k * BLOCK : NULL,
                       pf, acc, mr, 0);
        if (g->silu) {
            block_any_avx2(xf, k, k, g->w + blk[blocks + j] * k * BLOCK,
                           wf ? wf + (blocks + j) * k * BLOCK : NULL, pf, up, mr, 0);
            for (int i = 0; i < mr; i++)
                for (int h = 0; h < 2; h++) {
                    const __m256 gv = rounded8(acc[i][h], g->bias, c0 + 8 * h);
                    const __m256 uv = rounded8(up[i][h], g->bias, half_n + c0 + 8 * h);
                    const __m256 act = bf16x8_round(silu_v8(gv));
                    _mm_storeu_si128((__m128i *)((uint16_t *)g->out + (r0 + i) * half_n + c0 +
                                                 8 * h),
                                     bf16x8_from(_mm256_mul_ps(act, uv)));
                }
            continue;
        }
        for (int i = 0; i < mr; i++)
            for (int h = 0; h < 2; h++) {
                const __m256 v = rounded8(acc[i][h], g->bias, c0 + 8 * h);
                const int64_t at = (r0 + i) * g->n + c0 + 8 * h;
                if (g->f32_out)
                    _mm256_storeu_ps((float *)g->out + at, v);
                else /* v is a bf16 value already: rounding it again keeps it */
                    _mm_storeu_si128((__m128i *)((uint16_t *)g->out + at), bf16x8_from(v));
            }
    }
}

/* An fp32 model's linear (linear_f32 in bf16_gemm.c): mr rows of x (fp32, read in place)
 * x the nr blocks of the weights in f32_gemv.h's panels ([n / 16][k][16]: each block is what
 * widen_panel_avx2 makes of a bf16 one), out = the fp32 sums + bias, not rounded. */
AVX2 static void tile_f32_avx2(const f32_gemm_args *g, int64_t r0, const int64_t blk[NR],
                               prefetch_plan *pf, int mr, int nr) {
    __m256 acc[MR_AVX2][2];
    for (int j = 0; j < nr; j++) {
        const int64_t c0 = blk[j] * BLOCK;
        block_any_avx2(g->x + r0 * g->stride, g->stride, g->k, NULL, g->w + c0 * g->k, pf,
                       acc, mr, 1);
        for (int i = 0; i < mr; i++)
            for (int h = 0; h < 2; h++) {
                const __m256 v = acc[i][h];
                _mm256_storeu_ps(g->out + (r0 + i) * g->n + c0 + 8 * h,
                                 g->bias ? _mm256_add_ps(v, _mm256_loadu_ps(g->bias + c0 + 8 * h))
                                         : v);
            }
    }
}
#endif
#endif
