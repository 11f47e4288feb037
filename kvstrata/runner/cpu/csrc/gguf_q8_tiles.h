/* gguf_q8_run.h's AVX2 tiles and per-format calls, written once and included once per
 * instruction set (no include guard): the includer defines
 *   Q8_TARGET      the function attribute (GG_AVX2, or GG_VNNI: AVX-512 VNNI + VL)
 *   Q8_FN(name)    the name with its instruction set's suffix
 *   Q8_LANES       q8_lanes (vpmaddubsw + vpmaddwd) or q8_lanes_vnni (vpdpbusd)
 * Both lane functions give the same exact int32 lane sums (nothing saturates: see
 * gguf_q8_blocks.h), and everything after them is the same code, so both instances give the
 * same bits as each other and as the portable body. */

/* The min terms of rows r0.. x columns j0..: sum over groups of mins[c][g] * s[r][g], in
 * eight lanes by group (the tail's lanes masked to + 0 * 0, which leaves them as they are). */
Q8_TARGET static GG_INLINE float Q8_FN(q8_min_term)(const float *mins, const float *xs,
                                                    int64_t groups) {
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
Q8_TARGET static GG_INLINE void Q8_FN(q8_tile)(const int qt, const q8_args *a, int64_t r0,
                                               const int mr, int64_t j0, const int nc,
                                               float *mins) {
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
                const __m256i lanes = Q8_LANES(
                    is_signed, w, wabs, _mm256_loadu_si256((const __m256i *)(xq[r] + g * 32)));
                const __m256 scale = _mm256_mul_ps(wscale, _mm256_broadcast_ss(xd[r] + g));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), scale, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) {
            const float m = has_min ? Q8_FN(q8_min_term)(mins + c * groups,
                                                         a->xs + (r0 + r) * groups, groups)
                                    : 0.0f;
            a->out[(r0 + r) * a->out_stride + j0 + c] = gg_hsum(acc[r][c]) + m;
        }
}

/* Constant row and column counts at each call, so the tile's loops unroll into registers. */
#define Q8_COLS(MR)                                                    \
    switch (nc) {                                                      \
    case 4: Q8_FN(q8_tile)(qt, a, r0, MR, j0, 4, mins); return;        \
    case 3: Q8_FN(q8_tile)(qt, a, r0, MR, j0, 3, mins); return;        \
    case 2: Q8_FN(q8_tile)(qt, a, r0, MR, j0, 2, mins); return;        \
    default: Q8_FN(q8_tile)(qt, a, r0, MR, j0, 1, mins); return;       \
    }

Q8_TARGET static GG_INLINE void Q8_FN(q8_tile_any)(const int qt, const q8_args *a, int64_t r0,
                                                   int mr, int64_t j0, int nc, float *mins) {
    if (mr == 4) Q8_COLS(4)
    if (mr == 3) Q8_COLS(3)
    if (mr == 2) Q8_COLS(2)
    Q8_COLS(1)
}
#undef Q8_COLS

/* One format's whole call (qt a literal in each instance), as chunks for the pool
 * (gguf_pool.h): rows in blocks of Q8_ROW_BLOCK so a block's activation bytes stay in L2
 * while the threads sweep its quads. A chunk's mins scratch is on its thread's stack: 16
 * bytes per 32 inputs. */
#define Q8_RUN(QT, NAME)                                                                    \
    Q8_TARGET static void Q8_FN(NAME##_chunk)(const void *job, int64_t c, int worker) {      \
        const q8_job *j = job;                                                              \
        const q8_args *a = j->a;                                                            \
        int64_t b0, b1, q0, q1;                                                             \
        (void)worker;                                                                       \
        pool_grid_at(&j->grid, c, &b0, &b1, &q0, &q1);                                      \
        float mins[Q8_QUAD * (gg_has_min(QT) ? a->k / 32 : 1)];                             \
        for (int64_t jq = q0; jq < q1; jq++) {                                              \
            const int64_t j0 = jq * Q8_QUAD;                                                \
            const int nc = (int)(a->n - j0 < Q8_QUAD ? a->n - j0 : Q8_QUAD);                \
            for (int64_t r0 = b0; r0 < b1; r0 += Q8_TILE_ROWS)                              \
                Q8_FN(q8_tile_any)(QT, a, r0,                                               \
                                   (int)(b1 - r0 < Q8_TILE_ROWS ? b1 - r0 : Q8_TILE_ROWS),  \
                                   j0, nc, mins);                                           \
        }                                                                                   \
    }                                                                                       \
    static void Q8_FN(NAME)(const q8_args *a, int64_t m, int threads) {                     \
        const int64_t quads = (a->n + Q8_QUAD - 1) / Q8_QUAD;                               \
        const int nt = thread_count(threads, quads, a->row_bytes * a->n);                   \
        const q8_job j = {a, pool_grid_of(m, Q8_ROW_BLOCK, quads, Q8_QUAD * a->row_bytes,   \
                                          nt)};                                             \
        pool_run(Q8_FN(NAME##_chunk), &j, pool_grid_chunks(&j.grid), nt, m);                \
    }
Q8_RUN(GG_Q4_0, q8_run_q4_0)
Q8_RUN(GG_Q4_1, q8_run_q4_1)
Q8_RUN(GG_Q5_0, q8_run_q5_0)
Q8_RUN(GG_Q5_1, q8_run_q5_1)
Q8_RUN(GG_Q8_0, q8_run_q8_0)
Q8_RUN(GG_Q4_K, q8_run_q4_k)
Q8_RUN(GG_Q5_K, q8_run_q5_k)
Q8_RUN(GG_Q6_K, q8_run_q6_k)
#undef Q8_RUN

/* This instruction set's call for format qt. */
Q8_TARGET static void Q8_FN(q8_run)(int qt, const q8_args *a, int64_t m, int threads) {
    switch (qt) {
    case GG_Q4_0: Q8_FN(q8_run_q4_0)(a, m, threads); break;
    case GG_Q4_1: Q8_FN(q8_run_q4_1)(a, m, threads); break;
    case GG_Q5_0: Q8_FN(q8_run_q5_0)(a, m, threads); break;
    case GG_Q5_1: Q8_FN(q8_run_q5_1)(a, m, threads); break;
    case GG_Q8_0: Q8_FN(q8_run_q8_0)(a, m, threads); break;
    case GG_Q4_K: Q8_FN(q8_run_q4_k)(a, m, threads); break;
    case GG_Q5_K: Q8_FN(q8_run_q5_k)(a, m, threads); break;
    default: Q8_FN(q8_run_q6_k)(a, m, threads); break;
    }
}
