/* gguf_q8k_run.h's tiles and per-format calls, written once and included once per
 * instruction set (no include guard): the includer defines
 *   Q8K_TARGET        the function attribute (GG_AVX2, or GG_VNNI: AVX-512 VNNI + VL)
 *   Q8K_FN(name)      the name with its instruction set's suffix
 *   Q8K_ADD_SCALED    q8k_add_scaled (vpmaddwd + vpaddd) or q8k_add_scaled_vnni (vpdpwssd)
 * Both give the same exact int32 lanes, and the float steps after them are the same code, so
 * both instances give the same bits as each other and as q8k_dot_scalar. */

/* Columns j0.. (nc) x rows r0.. (mr): one column at a time (its row accumulators, float and
 * int, stay in registers: 2 x mr), each 32-weight group unpacked once and dotted with every
 * row of the tile; per super-block one convert and FMA per row (and the min term). */
Q8K_TARGET static GG_INLINE void Q8K_FN(q8k_tile)(const int qt, const q8k_args *a, int64_t r0,
                                                  const int mr, int64_t j0, const int nc) {
    const int64_t sbs = a->k / 256;
    const int bb = gg_block_bytes(qt), six = qt == GG_Q6_K;
    const int8_t *xq[Q8K_TILE_ROWS];
    const float *xd[Q8K_TILE_ROWS];
    const int16_t *xsum[Q8K_TILE_ROWS];
    for (int r = 0; r < mr; r++)
        xq[r] = a->xq + (r0 + r) * a->k, xd[r] = a->xd + (r0 + r) * sbs,
        xsum[r] = a->xsum + (r0 + r) * sbs * 8;
    for (int c = 0; c < nc; c++) {
        const uint8_t *row = a->w + (j0 + c) * a->row_bytes;
        __m256 acc[Q8K_TILE_ROWS];
        float minacc[Q8K_TILE_ROWS];
        for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps(), minacc[r] = 0.0f;
        for (int64_t sb = 0; sb < sbs; sb++) {
            const uint8_t *b = row + sb * bb;
            uint8_t sc[8], mn[8];
            __m256i sumi[Q8K_TILE_ROWS];
            for (int r = 0; r < mr; r++) sumi[r] = _mm256_setzero_si256();
            if (!six) q8k_scales_mins(b + 4, sc, mn);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                gg_scales unused; /* the float scales: dead code here */
                const __m256i w = gg_group_ints(qt, row, sb * 8 + j, &unused);
                const __m256i wabs = six ? _mm256_sign_epi8(w, w) : w;
                const __m256i scale16 =
                    six ? _mm256_set_m128i(_mm_set1_epi16((int8_t)b[192 + 2 * j + 1]),
                                           _mm_set1_epi16((int8_t)b[192 + 2 * j]))
                        : _mm256_set1_epi16(sc[j]);
                for (int r = 0; r < mr; r++) {
                    const __m256i x =
                        _mm256_loadu_si256((const __m256i *)(xq[r] + sb * 256 + 32 * j));
                    const __m256i pairs = six ? _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w))
                                              : _mm256_maddubs_epi16(w, x);
                    sumi[r] = Q8K_ADD_SCALED(sumi[r], pairs, scale16);
                }
            }
            const float d = gg_f16(b + (six ? 208 : 0));
            for (int r = 0; r < mr; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]),
                                         _mm256_set1_ps(d * xd[r][sb]), acc[r]);
            if (!six) {
                const float dmin = gg_f16(b + 2);
                uint64_t mins8;
                memcpy(&mins8, mn, 8);
                const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mins8));
                for (int r = 0; r < mr; r++) {
                    __m128i p = _mm_madd_epi16(
                        m16, _mm_loadu_si128((const __m128i *)(xsum[r] + sb * 8)));
                    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0x4E));
                    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0xB1));
                    minacc[r] = fmaf((float)_mm_cvtsi128_si32(p), dmin * xd[r][sb], minacc[r]);
                }
            }
        }
        for (int r = 0; r < mr; r++)
            a->out[(r0 + r) * a->out_stride + j0 + c] = gg_hsum(acc[r]) - minacc[r];
    }
}

/* Constant row and column counts at each call, so the tile's loops unroll into registers. */
#define Q8K_COLS(MR)                                                   \
    switch (nc) {                                                      \
    case 4: Q8K_FN(q8k_tile)(qt, a, r0, MR, j0, 4); return;            \
    case 3: Q8K_FN(q8k_tile)(qt, a, r0, MR, j0, 3); return;            \
    case 2: Q8K_FN(q8k_tile)(qt, a, r0, MR, j0, 2); return;            \
    default: Q8K_FN(q8k_tile)(qt, a, r0, MR, j0, 1); return;           \
    }

Q8K_TARGET static GG_INLINE void Q8K_FN(q8k_tile_any)(const int qt, const q8k_args *a,
                                                      int64_t r0, int mr, int64_t j0, int nc) {
    if (mr == 4) Q8K_COLS(4)
    if (mr == 3) Q8K_COLS(3)
    if (mr == 2) Q8K_COLS(2)
    Q8K_COLS(1)
}
#undef Q8K_COLS

/* One format's whole call (qt a literal in each instance), as chunks for the pool
 * (gguf_pool.h), rows in blocks of Q8K_ROW_BLOCK as gguf_q8_tiles.h's Q8_RUN. */
#define Q8K_RUN(QT, NAME)                                                                   \
    Q8K_TARGET static void Q8K_FN(NAME##_chunk)(const void *job, int64_t c, int worker) {    \
        const q8k_job *j = job;                                                             \
        const q8k_args *a = j->a;                                                           \
        int64_t b0, b1, q0, q1;                                                             \
        (void)worker;                                                                       \
        pool_grid_at(&j->grid, c, &b0, &b1, &q0, &q1);                                      \
        for (int64_t jq = q0; jq < q1; jq++) {                                              \
            const int64_t j0 = jq * Q8K_QUAD;                                               \
            const int nc = (int)(a->n - j0 < Q8K_QUAD ? a->n - j0 : Q8K_QUAD);              \
            for (int64_t r0 = b0; r0 < b1; r0 += Q8K_TILE_ROWS)                             \
                Q8K_FN(q8k_tile_any)(QT, a, r0,                                             \
                                     (int)(b1 - r0 < Q8K_TILE_ROWS ? b1 - r0 : Q8K_TILE_ROWS), \
                                     j0, nc);                                               \
        }                                                                                   \
    }                                                                                       \
    static void Q8K_FN(NAME)(const q8k_args *a, int64_t m, int threads) {                   \
        const int64_t quads = (a->n + Q8K_QUAD - 1) / Q8K_QUAD;                             \
        const int nt = thread_count(threads, quads, a->row_bytes * a->n);                   \
        const q8k_job j = {a, pool_grid_of(m, Q8K_ROW_BLOCK, quads, Q8K_QUAD * a->row_bytes, \
                                           nt)};                                            \
        pool_run(Q8K_FN(NAME##_chunk), &j, pool_grid_chunks(&j.grid), nt, m);               \
    }
Q8K_RUN(GG_Q4_K, q8k_run_q4_k)
Q8K_RUN(GG_Q5_K, q8k_run_q5_k)
Q8K_RUN(GG_Q6_K, q8k_run_q6_k)
#undef Q8K_RUN

Q8K_TARGET static void Q8K_FN(q8k_run)(int qt, const q8k_args *a, int64_t m, int threads) {
    switch (qt) {
    case GG_Q4_K: Q8K_FN(q8k_run_q4_k)(a, m, threads); break;
    case GG_Q5_K: Q8K_FN(q8k_run_q5_k)(a, m, threads); break;
    default: Q8K_FN(q8k_run_q6_k)(a, m, threads); break;
    }
}
