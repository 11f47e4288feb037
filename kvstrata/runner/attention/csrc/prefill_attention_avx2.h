/* AVX2 + FMA vector step of the causal prefill kernel (prefill_attention.h), for CPUs without
 * AVX-512: the same work item, scratch layout and online softmax on 8-lane registers.
 *
 * Why: on an AVX2-only EPYC (2 vCPUs) torch's SDPA ran SmolLM2's causal layer (9/3 heads of
 * 64, fp32) at 24 GFLOP/s of useful work at 128 tokens, 44 at 512 and 92 at 2048, against
 * ~128 for the fp32 GEMMs of the same prefill: a third of a 2048-token prefill was attention.
 *
 * How: the 64 keys of a block are scored in two halves of 32 (NR rows x 4 accumulators, the
 * 4 K^T vectors of a dimension loaded once for the NR rows, one broadcast query value: 13
 * of the 16 ymm registers at NR = 2), the softmax step runs over the block's 8 score vectors
 * with the causal edge masked, and the values are summed 32 dimensions at a time (NR x 4
 * accumulators, each V row's 4 vectors loaded once for the NR rows). d % 32 == 0. */
#ifndef KVSTRATA_PREFILL_ATTENTION_AVX2_H
#define KVSTRATA_PREFILL_ATTENTION_AVX2_H

#if defined(__x86_64__)
/* Lanes [0, valid - base) of an 8-lane chunk starting at key `base` are keys of the row. */
AVX2 static inline __m256 pf2_live(int64_t valid, int64_t base) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t left = valid - base;
    const __m256i n = _mm256_set1_epi32(left > 8 ? 8 : (int)left);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, lane));
}

/* K^T of a block (kt[e * PF_BK + c] = key c's dimension e; keys from nk on are zero), 8 keys
 * x 8 dimensions a tile: 8 row loads (bf16 widened on the way), an 8 x 8 transpose in
 * registers, 8 stores. The scalar fill (a 64-line strided store per key) took ~10% of a
 * block's time at 2048 tokens. */
AVX2 static inline __m256 pf2_row8(const char *base, int bf16, int64_t off) {
    return bf16 ? bf16x8_load((const uint16_t *)base + off) : _mm256_loadu_ps((const float *)base + off);
}
/* The 8 x 8 tile r (8 rows of 8 32-bit values) transposed into dst (rows `stride` floats
 * apart). Moves bits only: the bf16 kernel transposes bf16 pairs with it too. */
AVX2 static inline void pf2_transpose8(const __m256 r[8], float *dst, int64_t stride) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]),
                 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]),
                 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]),
                 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_store_ps(dst + 0 * stride, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_store_ps(dst + 1 * stride, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_store_ps(dst + 2 * stride, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_store_ps(dst + 3 * stride, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_store_ps(dst + 4 * stride, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_store_ps(dst + 5 * stride, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_store_ps(dst + 6 * stride, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_store_ps(dst + 7 * stride, _mm256_permute2f128_ps(u3, u7, 0x31));
}

AVX2 static void pf2_fill_kt(const char *k, int bf16, int64_t k_stride, const int64_t *sl,
                             int64_t nk, int64_t h, int64_t d, float *kt) {
    for (int64_t c0 = 0; c0 < PF_BK; c0 += 8) {
        for (int64_t e0 = 0; e0 < d; e0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = c0 + i < nk ? pf2_row8(k, bf16, sl[c0 + i] * k_stride + h * d + e0)
                                   : _mm256_setzero_ps();
            pf2_transpose8(r, kt + e0 * PF_BK + c0, PF_BK);
        }
    }
}

#define PF2_GROUP(NR)                                                                       \
    AVX2 static void pf2_group##NR(const float *q, const float *kt, const float *vf,        \
                                   int64_t valid, float *m, float *l, float *o, float *p,   \
                                   int64_t d) {                                             \
        for (int64_t k0 = 0; k0 < valid; k0 += 32) { /* scores, 32 keys a pass */           \
            __m256 acc[NR][4];                                                              \
            for (int r = 0; r < NR; r++)                                                    \
                for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();                \
            for (int64_t e = 0; e < d; e++) {                                               \
                const float *kr = kt + e * PF_BK + k0;                                      \
                const __m256 x0 = _mm256_load_ps(kr), x1 = _mm256_load_ps(kr + 8),          \
                             x2 = _mm256_load_ps(kr + 16), x3 = _mm256_load_ps(kr + 24);    \
                for (int r = 0; r < NR; r++) {                                              \
                    const __m256 qb = _mm256_broadcast_ss(q + r * d + e);                   \
                    acc[r][0] = _mm256_fmadd_ps(qb, x0, acc[r][0]);                         \
                    acc[r][1] = _mm256_fmadd_ps(qb, x1, acc[r][1]);                         \
                    acc[r][2] = _mm256_fmadd_ps(qb, x2, acc[r][2]);                         \
                    acc[r][3] = _mm256_fmadd_ps(qb, x3, acc[r][3]);                         \
                }                                                                           \
            }                                                                               \
            for (int r = 0; r < NR; r++)                                                    \
                for (int c = 0; c < 4; c++)                                                 \
                    _mm256_storeu_ps(p + r * PF_BK + k0 + 8 * c, acc[r][c]);                \
        }                                                                                   \
        float corr[NR];                                                                     \
        const __m256 ninf = _mm256_set1_ps(-INFINITY), zero = _mm256_setzero_ps();          \
        for (int r = 0; r < NR; r++) { /* the online-softmax step over the block */         \
            float *pr = p + r * PF_BK;                                                      \
            __m256 mx8 = ninf;                                                              \
            for (int64_t c = 0; c < valid; c += 8)                                          \
                mx8 = _mm256_max_ps(mx8, _mm256_blendv_ps(ninf, _mm256_loadu_ps(pr + c),     \
                                                          pf2_live(valid, c)));             \
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx8), _mm256_extractf128_ps(mx8, 1)); \
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));                                         \
            h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));                                     \
            float mx = _mm_cvtss_f32(h);                                                    \
            mx = m[r] > mx ? m[r] : mx;                                                     \
            corr[r] = m[r] == -INFINITY ? 0.f : expf(m[r] - mx);                            \
            const __m256 mv = _mm256_set1_ps(mx);                                           \
            __m256 sum = zero;                                                              \
            for (int64_t c = 0; c < valid; c += 8) {                                        \
                const __m256 pc = _mm256_blendv_ps(                                         \
                    zero, exp_nonpos_avx2(_mm256_sub_ps(_mm256_loadu_ps(pr + c), mv)),      \
                    pf2_live(valid, c));                                                    \
                _mm256_storeu_ps(pr + c, pc);                                               \
                sum = _mm256_add_ps(sum, pc);                                               \
            }                                                                               \
            m[r] = mx;                                                                      \
            l[r] = l[r] * corr[r] + hsum256(sum);                                           \
        }                                                                                   \
        for (int64_t e0 = 0; e0 < d; e0 += 32) { /* values, 32 dimensions a pass */         \
            __m256 acc[NR][4];                                                              \
            for (int r = 0; r < NR; r++) {                                                  \
                const __m256 cv = _mm256_set1_ps(corr[r]);                                  \
                for (int c = 0; c < 4; c++)                                                 \
                    acc[r][c] = _mm256_mul_ps(_mm256_load_ps(o + r * d + e0 + 8 * c), cv);  \
            }                                                                               \
            for (int64_t c = 0; c < valid; c++) {                                           \
                const float *vr = vf + c * d + e0;                                          \
                const __m256 v0 = _mm256_load_ps(vr), v1 = _mm256_load_ps(vr + 8),          \
                             v2 = _mm256_load_ps(vr + 16), v3 = _mm256_load_ps(vr + 24);    \
                for (int r = 0; r < NR; r++) {                                              \
                    const __m256 pb = _mm256_broadcast_ss(p + r * PF_BK + c);               \
                    acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);                         \
                    acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);                         \
                    acc[r][2] = _mm256_fmadd_ps(pb, v2, acc[r][2]);                         \
                    acc[r][3] = _mm256_fmadd_ps(pb, v3, acc[r][3]);                         \
                }                                                                           \
            }                                                                               \
            for (int r = 0; r < NR; r++)                                                    \
                for (int c = 0; c < 4; c++)                                                 \
                    _mm256_store_ps(o + r * d + e0 + 8 * c, acc[r][c]);                     \
        }                                                                                   \
    }
PF2_GROUP(1)
PF2_GROUP(2)
PF2_GROUP(3)
/* Rows a call takes: up to PF2_MAX_NR heads of a position share each K^T and V load. */
#define PF2_MAX_NR 3
static const pf_group_fn PF2_GROUPS[PF2_MAX_NR + 1] = {NULL, pf2_group1, pf2_group2,
                                                       pf2_group3};
#endif
#endif
