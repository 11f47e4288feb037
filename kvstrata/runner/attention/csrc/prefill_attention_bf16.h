/* The prefill kernel's step for a bf16 prompt over a bf16 pool on a CPU with AVX512-BF16
 * (prefill_attention.h's work item, scratch and online softmax; both products by vdpbf16ps).
 *
 * Why: the fp32 step widens every query, key and value to fp32 and multiplies them with fp32
 * FMAs, so a bf16 prefill paid for attention what an fp32 one did (130 vs 138 ms of a 13 x 157
 * token SmolLM2 prefill on an AVX-512 BF16 EPYC, 2 vCPUs) while its GEMMs ran 1.8x fp32's:
 * attention was 10% of the bf16 prefill and held served bf16 under 1.8x fp32. vdpbf16ps does
 * two multiply-adds a lane in one instruction, for both products.
 *
 * How (d % 64 == 0):
 * - scores: the query heads stay bf16 pairs as the projection wrote them (unscaled; the scale
 *   multiplies the sums), K^T of a block is stored as bf16 pairs, kt[e2 * PF_BK + c] = key c's
 *   dimensions 2 e2 and 2 e2 + 1 (a 32-bit transpose of the pool's rows, pf2_transpose8): a
 *   score row is d / 2 vdpbf16ps of a broadcast query pair over 4 vectors of 16 keys. The
 *   products of bf16 values are exact in fp32 and the sums fp32, as in the fp32 step.
 * - values: the block's probabilities (fp32 from the online softmax; the row's sum is taken
 *   over them) are rounded to bf16 pairs of consecutive keys, and V is stored as pairs of
 *   consecutive keys, vp[c2 * d + e] = (key 2 c2, key 2 c2 + 1)'s dimension e: a 16-dimension
 *   vector of the output takes one vdpbf16ps per key pair. Rounding the probabilities to bf16
 *   (relative error <= 2^-9 each, before the fp32 sums) is what flash attention does for its
 *   second product on bf16 hardware; the output is rounded to bf16 at the end anyway.
 */
#ifndef KVSTRATA_PREFILL_ATTENTION_BF16_H
#define KVSTRATA_PREFILL_ATTENTION_BF16_H

#if defined(__x86_64__)
/* K^T of a block as bf16 pairs: 8 keys x 8 pairs a tile (32-bit rows, transposed as bits). */
AVX512_BF16 static void pfb_fill_kt(const char *k, int64_t k_stride, const int64_t *sl,
                                    int64_t nk, int64_t h, int64_t d, uint32_t *kt) {
    for (int64_t c0 = 0; c0 < PF_BK; c0 += 8) {
        for (int64_t e2 = 0; e2 < d / 2; e2 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = c0 + i < nk ? _mm256_loadu_ps((const float *)((const uint16_t *)k +
                                                      sl[c0 + i] * k_stride + h * d) + e2)
                                   : _mm256_setzero_ps();
            pf2_transpose8(r, (float *)kt + e2 * PF_BK + c0, PF_BK);
        }
    }
}

/* V of a block as pairs of consecutive keys (keys from nk on are zero): the two rows'
 * 16-bit values interleaved, 32 dimensions a step (unpack within 128-bit lanes, then the
 * lanes put back in order). */
AVX512_BF16 static void pfb_fill_vp(const char *v, int64_t v_stride, const int64_t *sl,
                                    int64_t nk, int64_t h, int64_t d, uint32_t *vp) {
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int64_t c = 0; c < nk; c += 2) {
        const uint16_t *a = (const uint16_t *)v + sl[c] * v_stride + h * d;
        const uint16_t *b = c + 1 < nk ? (const uint16_t *)v + sl[c + 1] * v_stride + h * d
                                       : NULL;
        uint32_t *dst = vp + (c / 2) * d;
        for (int64_t e0 = 0; e0 < d; e0 += 32) {
            const __m512i x = _mm512_loadu_si512(a + e0);
            const __m512i y = b ? _mm512_loadu_si512(b + e0) : _mm512_setzero_si512();
            const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
            _mm512_store_si512(dst + e0, _mm512_permutex2var_epi64(lo, first, hi));
            _mm512_store_si512(dst + e0 + 16, _mm512_permutex2var_epi64(lo, second, hi));
        }
    }
}

/* NR (1-4) query heads of one position against one key block: scores (NR x 4 vectors of
 * 16 keys), the online-softmax step as pf_group, the probabilities as bf16 key pairs in pb
 * (NR x PF_BK / 2), then the weighted values 64 dimensions at a time. qp: the NR heads'
 * bf16 pairs (d / 2 each). */
#define PFB_GROUP(NR)                                                                       \
    AVX512_BF16 static void pfb_group##NR(const uint32_t *qp, const uint32_t *kt,            \
                                          const uint32_t *vp, int64_t valid, float *m,       \
                                          float *l, float *o, uint32_t *pb, int64_t d,       \
                                          float scale) {                                     \
        __m512 acc[NR][4];                                                                  \
        for (int r = 0; r < NR; r++)                                                        \
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();                    \
        for (int64_t e2 = 0; e2 < d / 2; e2++) {                                            \
            const uint32_t *kr = kt + e2 * PF_BK;                                           \
            const __m512bh k0 = (__m512bh)_mm512_load_si512(kr),                            \
                           k1 = (__m512bh)_mm512_load_si512(kr + 16),                       \
                           k2 = (__m512bh)_mm512_load_si512(kr + 32),                       \
                           k3 = (__m512bh)_mm512_load_si512(kr + 48);                       \
            for (int r = 0; r < NR; r++) {                                                  \
                const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qp[r * (d / 2) + e2]); \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qb);                            \
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qb);                            \
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], k2, qb);                            \
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], k3, qb);                            \
            }                                                                               \
        }                                                                                   \
        __mmask16 km[4];                                                                    \
        pf_key_masks(valid, km);                                                            \
        const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);          \
        const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80); /* bf16 1.0 */          \
        float corr[NR];                                                                     \
        for (int r = 0; r < NR; r++) {                                                      \
            __m512 mx4 = ninf;                                                              \
            for (int c = 0; c < 4; c++) {                                                   \
                acc[r][c] = _mm512_mul_ps(acc[r][c], sc);                                   \
                mx4 = _mm512_max_ps(mx4, _mm512_mask_blend_ps(km[c], ninf, acc[r][c]));     \
            }                                                                               \
            float mx = _mm512_reduce_max_ps(mx4);                                           \
            mx = m[r] > mx ? m[r] : mx;                                                     \
            corr[r] = m[r] == -INFINITY ? 0.f : expf(m[r] - mx);                            \
            const __m512 mv = _mm512_set1_ps(mx);                                           \
            __m512 pc[4];                                                                   \
            for (int c = 0; c < 4; c++)                                                     \
                pc[c] = _mm512_maskz_mov_ps(km[c],                                          \
                                            exp_nonpos_avx512(_mm512_sub_ps(acc[r][c], mv))); \
            const __m512bh p01 = _mm512_cvtne2ps_pbh(pc[1], pc[0]),                         \
                           p23 = _mm512_cvtne2ps_pbh(pc[3], pc[2]);                         \
            _mm512_store_si512(pb + r * (PF_BK / 2), (__m512i)p01);                         \
            _mm512_store_si512(pb + r * (PF_BK / 2) + 16, (__m512i)p23);                    \
            /* the sum of the rounded weights: they add up to 1 after the division */       \
            const __m512 sum = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), p01,  \
                                                                 ones), p23, ones);         \
            m[r] = mx;                                                                      \
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(sum);                              \
        }                                                                                   \
        for (int64_t e0 = 0; e0 < d; e0 += 64) {                                            \
            for (int r = 0; r < NR; r++) {                                                  \
                const __m512 cv = _mm512_set1_ps(corr[r]);                                  \
                for (int c = 0; c < 4; c++)                                                 \
                    acc[r][c] = _mm512_mul_ps(_mm512_load_ps(o + r * d + e0 + 16 * c), cv); \
            }                                                                               \
            for (int64_t c2 = 0; c2 < (valid + 1) / 2; c2++) {                              \
                const uint32_t *vr = vp + c2 * d + e0;                                      \
                const __m512bh v0 = (__m512bh)_mm512_load_si512(vr),                        \
                               v1 = (__m512bh)_mm512_load_si512(vr + 16),                   \
                               v2 = (__m512bh)_mm512_load_si512(vr + 32),                   \
                               v3 = (__m512bh)_mm512_load_si512(vr + 48);                   \
                for (int r = 0; r < NR; r++) {                                              \
                    const __m512bh pp =                                                     \
                        (__m512bh)_mm512_set1_epi32((int)pb[r * (PF_BK / 2) + c2]);         \
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], v0, pp);                        \
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], v1, pp);                        \
                    acc[r][2] = _mm512_dpbf16_ps(acc[r][2], v2, pp);                        \
                    acc[r][3] = _mm512_dpbf16_ps(acc[r][3], v3, pp);                        \
                }                                                                           \
            }                                                                               \
            for (int r = 0; r < NR; r++)                                                    \
                for (int c = 0; c < 4; c++)                                                 \
                    _mm512_store_ps(o + r * d + e0 + 16 * c, acc[r][c]);                    \
        }                                                                                   \
    }
PFB_GROUP(1)
PFB_GROUP(2)
PFB_GROUP(3)
PFB_GROUP(4)
typedef void (*pfb_group_fn)(const uint32_t *, const uint32_t *, const uint32_t *, int64_t,
                             float *, float *, float *, uint32_t *, int64_t, float);
static const pfb_group_fn PFB_GROUPS[5] = {NULL, pfb_group1, pfb_group2, pfb_group3,
                                           pfb_group4};
#endif

/* Whether a call takes this step: a bf16 prompt on the AVX-512 step where the CPU has
 * AVX512-BF16. */
static int pfb_supported(int vec, int bf16) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return vec == ISA_AVX512 && bf16 && __builtin_cpu_supports("avx512bf16");
#else
    (void)vec; (void)bf16;
    return 0;
#endif
}
#endif
