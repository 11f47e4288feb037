/* GGUF weight blocks (ggml's layouts) dequantized 32 weights at a time into four ymm
 * registers of fp32, on AVX2 + FMA + F16C; gguf_ops.c multiplies them. Written from the
 * layouts as the `gguf` Python package documents them (gguf.quants); no ggml code.
 *
 * A "group" is 32 consecutive weights along k: one whole block of Q4_0 / Q4_1 / Q5_0 / Q5_1 /
 * Q8_0 (32 values), one eighth of a 256-value super-block of Q4_K / Q5_K / Q6_K. A group is
 * first its 32 integer weights and scales (gg_group_ints: what the 8-bit-activation kernel of
 * gguf_q8_blocks.h multiplies), w = scale * int + min (scale: per 16 weights). Each weight
 * comes out as exactly the fp32 value gguf.quants.dequantize gives it: the same products and
 * sums in the same order, one rounding each (gguf_ops.c is built with -ffp-contract=off, so
 * no mul and add are fused behind our back).
 *
 *   Q4_0  18 B: f16 d, 16 B nibbles (low nibbles weights 0-15, high 16-31); w = d * (q - 8)
 *   Q4_1  20 B: f16 d, f16 m, 16 B nibbles as Q4_0;                        w = d * q + m
 *   Q5_0  22 B: f16 d, 32 high bits (bit i: weight i), nibbles as Q4_0;    w = d * (q - 16)
 *   Q5_1  24 B: f16 d, f16 m, 32 high bits, nibbles as Q4_0;               w = d * q + m
 *   Q8_0  34 B: f16 d, 32 int8;                                             w = q * d
 *   Q4_K 144 B: f16 d, f16 dmin, 12 B of eight 6-bit (scale, min) pairs, 128 B nibbles: group
 *               j reads bytes 32 * (j / 2).. at nibble j % 2;  w = (d * sc_j) * q - dmin * m_j
 *   Q5_K 176 B: as Q4_K, then 32 B of high bits (group j: bit j of byte i) before the nibbles
 *   Q6_K 210 B: 128 B low nibbles, 64 B 2-bit highs, 16 int8 scales (one per 16 weights), f16 d;
 *               group j = 4 h + t: low nibble (t / 2) of bytes 64 h + 32 (t % 2).., high bits
 *               2 t.. of bytes 32 h..;                          w = (d * sc_16) * (q - 32)
 */
#ifndef KVSTRATA_GGUF_BLOCKS_AVX2_H
#define KVSTRATA_GGUF_BLOCKS_AVX2_H
#include <stdint.h>
#include <string.h>

/* gguf.GGMLQuantizationType values */
enum {
    GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8,
    GG_Q4_K = 12, GG_Q5_K = 13, GG_Q6_K = 14
};

/* Bytes of one block and weights per block. */
static inline int gg_block_bytes(int qt) {
    switch (qt) {
    case GG_Q4_0: return 18;
    case GG_Q4_1: return 20;
    case GG_Q5_0: return 22;
    case GG_Q5_1: return 24;
    case GG_Q8_0: return 34;
    case GG_Q4_K: return 144;
    case GG_Q5_K: return 176;
    case GG_Q6_K: return 210;
    default: return 0;
    }
}
static inline int gg_block_values(int qt) { return qt >= GG_Q4_K ? 256 : 32; }
#define GG_INLINE inline __attribute__((always_inline))

/* A group's scales: w = scale0 * int (weights 0-15; scale1: 16-31) + min. */
typedef struct {
    float scale0, scale1, min;
} gg_scales;

/* Whether a format's integer weights are unsigned with a min (else signed, min 0). */
static inline int gg_has_min(const int qt) {
    return qt == GG_Q4_1 || qt == GG_Q5_1 || qt == GG_Q4_K || qt == GG_Q5_K;
}

/* The 6-bit scale and min of group j of a Q4_K / Q5_K super-block (s: its 12 bytes). */
static GG_INLINE void gg_scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

#if defined(__x86_64__)
#include <immintrin.h>
#define GG_AVX2 __attribute__((target("avx2,fma,f16c")))

GG_AVX2 static GG_INLINE float gg_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 32 bytes -> 4 x 8 fp32 (zero- or sign-extended). */
GG_AVX2 static GG_INLINE void gg_widen(__m256i b, const int is_signed, __m256 v[4]) {
    const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        v[i] = _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(part[i])
                                            : _mm256_cvtepu8_epi32(part[i]));
}

/* Q5_0 / Q5_1's 32 high bits (little-endian, bit i: weight i) as 0x10 in byte i. */
GG_AVX2 static GG_INLINE __m256i gg_high_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8( /* byte i <- byte i / 8 of the bits */
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i mask = _mm256_set1_epi64x(0x8040201008040201); /* bit i % 8 */
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* Group g (of k / 32) of one weight row: its 32 integer weights as bytes in weight order
 * (signed for Q4_0 / Q5_0 / Q8_0 / Q6_K, unsigned for the formats with a min) and its scales
 * (the header's table: Q4_0 q - 8, d; Q4_1 q, d, m; Q5_0 q - 16, d; Q5_1 q, d, m; Q8_0 q, d;
 * Q4_K / Q5_K q, d * sc_j, -(dmin * m_j); Q6_K q - 32, d * sc_16). qt is a literal at every
 * call site (the branches fold away). */
GG_AVX2 static GG_INLINE __m256i gg_group_ints(const int qt, const uint8_t *row, int64_t g,
                                               gg_scales *sc) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    sc->min = 0.0f;
    if (qt == GG_Q4_0 || qt == GG_Q4_1 || qt == GG_Q5_0 || qt == GG_Q5_1 || qt == GG_Q8_0) {
        const uint8_t *b = row + g * gg_block_bytes(qt);
        sc->scale0 = sc->scale1 = gg_f16(b);
        if (qt == GG_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
        const int with_min = qt == GG_Q4_1 || qt == GG_Q5_1, five = qt == GG_Q5_0 || qt == GG_Q5_1;
        const uint8_t *nibbles = b + 2 + 2 * with_min + 4 * five;
        const __m128i q = _mm_loadu_si128((const __m128i *)nibbles);
        __m256i q32 = _mm256_and_si256(
            _mm256_set_m128i(_mm_srli_epi16(q, 4), q), nib); /* weights 0-15 | 16-31 */
        if (five) q32 = _mm256_or_si256(q32, gg_high_bits(nibbles - 4));
        if (with_min) {
            sc->min = gg_f16(b + 2);
            return q32;
        }
        return _mm256_sub_epi8(q32, _mm256_set1_epi8(five ? 16 : 8));
    }
    const uint8_t *b = row + (g >> 3) * gg_block_bytes(qt);
    const int j = (int)(g & 7);
    if (qt == GG_Q6_K) {
        const int h = j >> 2, t = j & 3;
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (t & 1)));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m256i ql = _mm256_and_si256(_mm256_srli_epi16(lo, 4 * (t >> 1)), nib);
        const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * t), _mm256_set1_epi8(3));
        const float d = gg_f16(b + 208);
        sc->scale0 = d * (float)(int8_t)b[192 + 2 * j];
        sc->scale1 = d * (float)(int8_t)b[192 + 2 * j + 1];
        return _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)),
                               _mm256_set1_epi8(32));
    }
    int scl, mn; /* Q4_K, Q5_K */
    gg_scale_min_k4(b + 4, j, &scl, &mn);
    sc->scale0 = sc->scale1 = gg_f16(b) * (float)scl;
    sc->min = -(gg_f16(b + 2) * (float)mn);
    const uint8_t *qs = b + (qt == GG_Q5_K ? 48 : 16) + 32 * (j >> 1);
    __m256i q = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)qs), 4 * (j & 1)), nib);
    if (qt == GG_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)),
                                             _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
}

/* Group g of one weight row: its 32 dequantized weights, in order, into v[4]: scale * int
 * (+ min), one rounding each, as gguf computes them (x - y is x + (-y) bit for bit). */
GG_AVX2 static GG_INLINE void gg_group(const int qt, const uint8_t *row, int64_t g,
                                       __m256 v[4]) {
    gg_scales sc;
    gg_widen(gg_group_ints(qt, row, g, &sc), !gg_has_min(qt), v);
    const __m256 s0 = _mm256_set1_ps(sc.scale0), s1 = _mm256_set1_ps(sc.scale1);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_mul_ps(i < 2 ? s0 : s1, v[i]);
        if (gg_has_min(qt)) v[i] = _mm256_add_ps(v[i], _mm256_set1_ps(sc.min));
    }
}

/* The fixed tree every output's 8 lanes are summed in (lanes i + 4, then i + 2, then i + 1). */
GG_AVX2 static GG_INLINE float gg_hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif
#endif
