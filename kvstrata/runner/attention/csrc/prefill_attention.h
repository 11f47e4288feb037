/* Causal prefill attention of a chunk over its own keys (no cached prefix), included by
 * paged_decode.c:
 *
 *   prefill(q, q_stride, q_rows, k_cache, v_cache, pool_rows, slots, n_slots, seqs, n_seqs,
 *           hq, hkv, d, dtype, scale, out, num_threads, isa_cap) -> name of the ISA used
 *
 * Token row t's query heads are q[t * q_stride ...] ([hq][d], contiguous: a view of the
 * fused qkv projection of a whole batch, read in place). Keys and values are read from one
 * layer of the paged pool ([pool_rows][hkv][d]), where the step's new tokens were already
 * written. seqs holds n_seqs (q_lo, q_hi, slot_off, prefix) int64 quadruples, each a prompt
 * (or a chunk of one) after `prefix` cached tokens: query row q_lo + t is position
 * prefix + t and attends to positions 0 .. prefix + t, position c at pool row
 * slots[slot_off + c]. Query head i reads KV head i / (hq / hkv). out is [rows][hq][d],
 * contiguous, of q's dtype (fp32 or bf16; the pool the same); only the prompts' rows are
 * written. One call serves every prompt of a batched prefill, with or without a prefix-cache
 * hit: one parallel region a layer, not one per request, and nothing gathered.
 *
 * Why: torch's CPU flash attention reached 50-120 GFLOP/s at head_dim 64 on an AVX-512 box
 * whose fp32 GEMMs run at ~170 (a causal 9-head layer of 512 tokens: 5.4 ms), so attention
 * was ~25% of a batched prefill of 128-token prompts and ~70% of a 2048-token one.
 *
 * How: a work item is one KV head x a block of PF_BQ query positions: its g = hq / hkv query
 * heads' rows (g x PF_BQ of them, widened to fp32 and scaled once) meet each block of PF_BK
 * keys once: the block is widened and transposed into L1 ([d][PF_BK]: a score row is
 * d broadcast-FMAs over two 16-wide vectors, no horizontal sums), then an online softmax
 * (running max and sum per row, fp32) and the weighted sum of the block's values. Items run
 * on torch's OpenMP team (see paged_decode.c), dynamically scheduled (causal blocks differ
 * in cost). AVX-512F (d % 64 == 0) or AVX2 + FMA (d % 32 == 0, prefill_attention_avx2.h),
 * picked at run time; d <= PF_MAX_D; a bf16 prompt on AVX512-BF16 keeps its values bf16 and
 * multiplies pairs instead (prefill_attention_bf16.h). The scalar code here is the reference
 * the tests hold the vector code to.
 */
#ifndef KVSTRATA_PREFILL_ATTENTION_H
#define KVSTRATA_PREFILL_ATTENTION_H
#include <math.h>
#include "paged_decode_isa.h"

#define PF_BQ 32
#define PF_BK 64
#define PF_MAX_D 256

typedef struct {
    const char *q, *k, *v;
    char *out;
    const int64_t *slots;
    int64_t hq, hkv, d, q_stride, k_stride, v_stride;
    int bf16, vec, dp; /* dp: the bf16 step (prefill_attention_bf16.h) */
    float scale;
} pf_job;

/* PF_BQ query positions of one prompt: query rows q_lo + q0 .. + nq at positions prefix + q0
 * .., key position c at pool row slots[slot_off + c]; cost orders the work (keys to read). */
typedef struct { int64_t q_lo, q0, nq, slot_off, prefix, cost; } pf_block;

typedef struct { float *qf, *o, *m, *l, *kt, *vf, *p; } pf_scratch;

static int pf_scratch_alloc(pf_scratch *s, const pf_job *j) {
    const int64_t rows = PF_BQ * (j->hq / j->hkv);
    s->qf = aligned_alloc(64, (size_t)(rows * j->d) * sizeof(float));
    s->o = aligned_alloc(64, (size_t)(rows * j->d) * sizeof(float));
    s->m = malloc((size_t)rows * sizeof(float));
    s->l = malloc((size_t)rows * sizeof(float));
    s->kt = aligned_alloc(64, (size_t)(j->d * PF_BK) * sizeof(float));
    s->vf = aligned_alloc(64, (size_t)(PF_BK * j->d) * sizeof(float));
    s->p = aligned_alloc(64, (size_t)(4 * PF_BK) * sizeof(float));
    return s->qf && s->o && s->m && s->l && s->kt && s->vf && s->p ? 0 : -1;
}
static void pf_scratch_free(pf_scratch *s) {
    free(s->qf); free(s->o); free(s->m); free(s->l); free(s->kt); free(s->vf); free(s->p);
}

static inline void pf_load(const pf_job *j, float *dst, const char *base, int64_t off,
                           int64_t n) {
    if (j->bf16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + off, (size_t)n * sizeof(float));
    }
}

/* KV head h's K and V rows of key positions [k0, min(k0 + PF_BK, end)) into the caches: rows
 * are scattered over the pool (one slot per position), so a block read cold waits on a miss
 * per row, which the transposes do not hide. Issued one block ahead; moves no bits. Decode
 * rows in this order (decode_fixed.h) read every key once a step: 32 rows at 160 keys of
 * context, bf16, 1 thread, rows shuffled over a 7.7 MB pool (AVX-512 BF16 EPYC, CPU time,
 * box at load ~45): 4.4x -> 1.7x the decode kernel's time. */
static inline void pf_prefetch_block(const pf_job *j, const int64_t *sl, int64_t k0,
                                     int64_t end, int64_t h) {
    const int64_t esz = j->bf16 ? 2 : 4, bytes = j->d * esz;
    const int64_t stop = k0 + PF_BK < end ? k0 + PF_BK : end;
    for (int64_t c = k0; c < stop; c++) {
        const char *kr = j->k + (sl[c] * j->k_stride + h * j->d) * esz;
        const char *vr = j->v + (sl[c] * j->v_stride + h * j->d) * esz;
        for (int64_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch(kr + b, 0, 3);
            __builtin_prefetch(vr + b, 0, 3);
        }
    }
}

/* One row's scores against the block's keys (s[0..PF_BK)), fp32. */
static void pf_scores_scalar(const float *q, const float *kt, int64_t d, float *s) {
    for (int c = 0; c < PF_BK; c++) s[c] = 0.f;
    for (int64_t e = 0; e < d; e++)
        for (int c = 0; c < PF_BK; c++) s[c] += q[e] * kt[e * PF_BK + c];
}
#if defined(__x86_64__)
/* The live keys of a block's 4 vectors of 16 (valid of PF_BK). */
static inline void pf_key_masks(int64_t valid, __mmask16 km[4]) {
    for (int c = 0; c < 4; c++) {
        const int64_t left = valid - 16 * c;
        km[c] = left >= 16 ? 0xFFFF : (left > 0 ? (__mmask16)((1u << left) - 1) : 0);
    }
}

/* NR (1-4) query heads of one position against one key block (PF_BK = 64 keys: 4 vectors),
 * everything in registers: the scores (NR x 4 vectors: each K^T row loaded once for the NR
 * heads), the online-softmax step, then the weighted values 64 dims at a time (NR x 4
 * accumulators; each value row loaded once for the NR heads). d % 64 == 0. */
#define PF_GROUP(NR)                                                                        \
    AVX512 static void pf_group##NR(const float *q, const float *kt, const float *vf,       \
                                    int64_t valid, float *m, float *l, float *o, float *p,  \
                                    int64_t d) {                                            \
        __m512 acc[NR][4];                                                                  \
        for (int r = 0; r < NR; r++)                                                        \
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();                    \
        for (int64_t e = 0; e < d; e++) {                                                   \
            const float *kr = kt + e * PF_BK;                                               \
            const __m512 k0 = _mm512_load_ps(kr), k1 = _mm512_load_ps(kr + 16),             \
                         k2 = _mm512_load_ps(kr + 32), k3 = _mm512_load_ps(kr + 48);        \
            for (int r = 0; r < NR; r++) {                                                  \
                const __m512 qb = _mm512_set1_ps(q[r * d + e]);                             \
                acc[r][0] = _mm512_fmadd_ps(qb, k0, acc[r][0]);                             \
                acc[r][1] = _mm512_fmadd_ps(qb, k1, acc[r][1]);                             \
                acc[r][2] = _mm512_fmadd_ps(qb, k2, acc[r][2]);                             \
                acc[r][3] = _mm512_fmadd_ps(qb, k3, acc[r][3]);                             \
            }                                                                               \
        }                                                                                   \
        __mmask16 km[4];                                                                    \
        pf_key_masks(valid, km);                                                            \
        const __m512 ninf = _mm512_set1_ps(-INFINITY);                                      \
        float corr[NR];                                                                     \
        for (int r = 0; r < NR; r++) {                                                      \
            __m512 mx4 = ninf;                                                              \
            for (int c = 0; c < 4; c++)                                                     \
                mx4 = _mm512_max_ps(mx4, _mm512_mask_blend_ps(km[c], ninf, acc[r][c]));     \
            float mx = _mm512_reduce_max_ps(mx4);                                           \
            mx = m[r] > mx ? m[r] : mx;                                                     \
            corr[r] = m[r] == -INFINITY ? 0.f : expf(m[r] - mx);                            \
            const __m512 mv = _mm512_set1_ps(mx);                                           \
            __m512 sum = _mm512_setzero_ps();                                               \
            for (int c = 0; c < 4; c++) {                                                   \
                const __m512 pc = _mm512_maskz_mov_ps(                                      \
                    km[c], exp_nonpos_avx512(_mm512_sub_ps(acc[r][c], mv)));                \
                _mm512_storeu_ps(p + r * PF_BK + 16 * c, pc);                               \
                sum = _mm512_add_ps(sum, pc);                                               \
            }                                                                               \
            m[r] = mx;                                                                      \
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(sum);                              \
        }                                                                                   \
        for (int64_t e0 = 0; e0 < d; e0 += 64) {                                            \
            for (int r = 0; r < NR; r++) {                                                  \
                const __m512 cv = _mm512_set1_ps(corr[r]);                                  \
                for (int c = 0; c < 4; c++)                                                 \
                    acc[r][c] = _mm512_mul_ps(_mm512_load_ps(o + r * d + e0 + 16 * c), cv); \
            }                                                                               \
            for (int64_t c = 0; c < valid; c++) {                                           \
                const float *vr = vf + c * d + e0;                                          \
                const __m512 v0 = _mm512_load_ps(vr), v1 = _mm512_load_ps(vr + 16),         \
                             v2 = _mm512_load_ps(vr + 32), v3 = _mm512_load_ps(vr + 48);    \
                for (int r = 0; r < NR; r++) {                                              \
                    const __m512 pb = _mm512_set1_ps(p[r * PF_BK + c]);                     \
                    acc[r][0] = _mm512_fmadd_ps(pb, v0, acc[r][0]);                         \
                    acc[r][1] = _mm512_fmadd_ps(pb, v1, acc[r][1]);                         \
                    acc[r][2] = _mm512_fmadd_ps(pb, v2, acc[r][2]);                         \
                    acc[r][3] = _mm512_fmadd_ps(pb, v3, acc[r][3]);                         \
                }                                                                           \
            }                                                                               \
            for (int r = 0; r < NR; r++)                                                    \
                for (int c = 0; c < 4; c++)                                                 \
                    _mm512_store_ps(o + r * d + e0 + 16 * c, acc[r][c]);                    \
        }                                                                                   \
    }
PF_GROUP(1)
PF_GROUP(2)
PF_GROUP(3)
PF_GROUP(4)
typedef void (*pf_group_fn)(const float *, const float *, const float *, int64_t, float *,
                            float *, float *, float *, int64_t);
static const pf_group_fn PF_GROUPS[5] = {NULL, pf_group1, pf_group2, pf_group3, pf_group4};
#endif
#include "prefill_attention_avx2.h"
#include "prefill_attention_bf16.h"
static void pf_accumulate_scalar(float *o, float corr, const float *p, const float *vf,
                                 int64_t nv, int64_t d) {
    for (int64_t e = 0; e < d; e++) {
        float acc = o[e] * corr;
        for (int64_t c = 0; c < nv; c++) acc += p[c] * vf[c * d + e];
        o[e] = acc;
    }
}

/* KV head h, query positions [q0, q0 + nq) of the sequence whose position 0 is token row
 * `base` of q, k, v and out. */
static void pf_item(const pf_job *j, pf_scratch *sc, const pf_block *b, int64_t h) {
    const int64_t base = b->q_lo, q0 = b->q0, nq = b->nq, prefix = b->prefix;
    const int64_t *sl = j->slots + b->slot_off; /* key position -> pool row */
    const int64_t g = j->hq / j->hkv, d = j->d, rows = nq * g;
    for (int64_t t = 0; t < nq; t++)
        for (int64_t i = 0; i < g; i++) {
            const int64_t off = (base + q0 + t) * j->q_stride + (h * g + i) * d;
            if (j->dp) { /* bf16 pairs as they are, d / 2 a row; scaled after the sums */
                memcpy((uint32_t *)sc->qf + (t * g + i) * (d / 2),
                       (const uint16_t *)j->q + off, (size_t)d * 2);
                continue;
            }
            float *qr = sc->qf + (t * g + i) * d;
            pf_load(j, qr, j->q, off, d);
            for (int64_t e = 0; e < d; e++) qr[e] *= j->scale;
        }
    memset(sc->o, 0, (size_t)(rows * d) * sizeof(float));
    for (int64_t r = 0; r < rows; r++) { sc->m[r] = -INFINITY; sc->l[r] = 0.f; }
    float row[PF_MAX_D], s[PF_BK], p[PF_BK];
    const int64_t end = prefix + q0 + nq; /* key positions [0, end) */
    pf_prefetch_block(j, sl, 0, end, h);
    for (int64_t k0 = 0; k0 < end; k0 += PF_BK) {
        const int64_t nk = end - k0 < PF_BK ? end - k0 : PF_BK;
        if (k0 + PF_BK < end) pf_prefetch_block(j, sl, k0 + PF_BK, end, h);
#if defined(__x86_64__)
        if (j->dp) { /* bf16 pairs: K^T and V as prefill_attention_bf16.h lays them out */
            pfb_fill_kt(j->k, j->k_stride, sl + k0, nk, h, d, (uint32_t *)sc->kt);
            pfb_fill_vp(j->v, j->v_stride, sl + k0, nk, h, d, (uint32_t *)sc->vf);
        } else if (j->vec) { /* d % 32 == 0 on both vector paths */
            pf2_fill_kt(j->k, j->bf16, j->k_stride, sl + k0, nk, h, d, sc->kt);
        } else
#endif
        for (int64_t c = 0; c < PF_BK; c++) {
            if (c < nk) pf_load(j, row, j->k, sl[k0 + c] * j->k_stride + h * d, d);
            for (int64_t e = 0; e < d; e++) sc->kt[e * PF_BK + c] = c < nk ? row[e] : 0.f;
        }
        for (int64_t c = 0; !j->dp && c < nk; c++)
            pf_load(j, sc->vf + c * d, j->v, sl[k0 + c] * j->v_stride + h * d, d);
        for (int64_t t = 0; t < nq; t++) {
            const int64_t seen = prefix + q0 + t - k0 + 1; /* causal: keys <= its position */
            const int64_t valid = seen < nk ? seen : nk;
            if (valid <= 0) continue;
#if defined(__x86_64__)
            if (j->dp) { /* the g heads of position t, up to 4 at a time */
                for (int64_t i = 0; i < g; i += 4) {
                    const int64_t r = t * g + i, nr = g - i < 4 ? g - i : 4;
                    PFB_GROUPS[nr]((const uint32_t *)sc->qf + r * (d / 2),
                                   (const uint32_t *)sc->kt, (const uint32_t *)sc->vf, valid,
                                   sc->m + r, sc->l + r, sc->o + r * d, (uint32_t *)sc->p, d,
                                   j->scale);
                }
                continue;
            }
            if (j->vec) { /* the g heads of position t, up to 4 (AVX2: 3) at a time */
                const int64_t most = j->vec == ISA_AVX512 ? 4 : PF2_MAX_NR;
                const pf_group_fn *fns = j->vec == ISA_AVX512 ? PF_GROUPS : PF2_GROUPS;
                for (int64_t i = 0; i < g; i += most) {
                    const int64_t r = t * g + i, nr = g - i < most ? g - i : most;
                    fns[nr](sc->qf + r * d, sc->kt, sc->vf, valid, sc->m + r, sc->l + r,
                            sc->o + r * d, sc->p, d);
                }
                continue;
            }
#endif
            for (int64_t i = 0; i < g; i++) {
                const int64_t r = t * g + i;
                pf_scores_scalar(sc->qf + r * d, sc->kt, d, s);
                float mx = sc->m[r];
                for (int64_t c = 0; c < valid; c++) mx = s[c] > mx ? s[c] : mx;
                const float corr = sc->m[r] == -INFINITY ? 0.f : expf(sc->m[r] - mx);
                float sum = 0.f;
                for (int64_t c = 0; c < valid; c++) { p[c] = expf(s[c] - mx); sum += p[c]; }
                sc->m[r] = mx;
                sc->l[r] = sc->l[r] * corr + sum;
                pf_accumulate_scalar(sc->o + r * d, corr, p, sc->vf, valid, d);
            }
        }
    }
    for (int64_t t = 0; t < nq; t++)
        for (int64_t i = 0; i < g; i++) {
            const float *o = sc->o + (t * g + i) * d;
            const float inv = 1.f / sc->l[t * g + i];
            const int64_t off = ((base + q0 + t) * j->hq + h * g + i) * d;
            if (j->bf16) {
                uint16_t *dst = (uint16_t *)j->out + off;
                for (int64_t e = 0; e < d; e++) dst[e] = f32_to_bf16(o[e] * inv);
            } else {
                float *dst = (float *)j->out + off;
                for (int64_t e = 0; e < d; e++) dst[e] = o[e] * inv;
            }
        }
}

#endif
