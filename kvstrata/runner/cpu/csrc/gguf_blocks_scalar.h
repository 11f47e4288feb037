/* The portable body of gguf_ops.c (any CPU, or KVSTRATA_CPU_ISA=scalar): the same group
 * layouts as gguf_blocks_avx2.h (its header comment lists them), the same fp32 operations on
 * each weight, and the same summation order for each output (eight lane sums, an FMA per
 * weight in k order, gg_hsum's tree), so it gives the AVX2 body's bits exactly: slower, but
 * still exact to gguf's dequantized values and batch-invariant. fmaf is C99's fused
 * multiply-add (one rounding, as the AVX2 body's vfmadd). */
#ifndef KVSTRATA_GGUF_BLOCKS_SCALAR_H
#define KVSTRATA_GGUF_BLOCKS_SCALAR_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* IEEE half -> float, exact for every value (normal, subnormal, zero, inf, NaN). */
static inline float gg_f16_scalar(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h >> 15) << 31;
    int exp = (h >> 10) & 0x1F;
    uint32_t mant = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp) {
        bits = sign | ((uint32_t)(exp + 112) << 23) | (mant << 13);
    } else if (!mant) {
        bits = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | ((uint32_t)exp << 23) | ((mant & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Group g of one weight row: its 32 integer weights and scales (gg_group_ints's). */
static inline void gg_group_ints_scalar(const int qt, const uint8_t *row, int64_t g, int w[32],
                                        gg_scales *sc) {
    sc->min = 0.0f;
    if (qt == GG_Q4_0 || qt == GG_Q4_1 || qt == GG_Q5_0 || qt == GG_Q5_1 || qt == GG_Q8_0) {
        const uint8_t *b = row + g * gg_block_bytes(qt);
        sc->scale0 = sc->scale1 = gg_f16_scalar(b);
        if (qt == GG_Q8_0) {
            for (int i = 0; i < 32; i++) w[i] = (int8_t)b[2 + i];
            return;
        }
        const int with_min = qt == GG_Q4_1 || qt == GG_Q5_1, five = qt == GG_Q5_0 || qt == GG_Q5_1;
        const uint8_t *nibbles = b + 2 + 2 * with_min + 4 * five;
        uint32_t high = 0;
        if (five) memcpy(&high, nibbles - 4, 4);
        if (with_min) sc->min = gg_f16_scalar(b + 2);
        for (int i = 0; i < 32; i++) {
            int q = (i < 16 ? nibbles[i] : nibbles[i - 16] >> 4) & 0x0F;
            q |= (int)((high >> i) & 1) << 4;
            w[i] = with_min ? q : q - (five ? 16 : 8);
        }
        return;
    }
    const uint8_t *b = row + (g >> 3) * gg_block_bytes(qt);
    const int j = (int)(g & 7);
    if (qt == GG_Q6_K) {
        const int h = j >> 2, t = j & 3;
        const uint8_t *lo = b + 64 * h + 32 * (t & 1), *hi = b + 128 + 32 * h;
        const float d = gg_f16_scalar(b + 208);
        sc->scale0 = d * (float)(int8_t)b[192 + 2 * j];
        sc->scale1 = d * (float)(int8_t)b[192 + 2 * j + 1];
        for (int i = 0; i < 32; i++)
            w[i] = (((lo[i] >> (4 * (t >> 1))) & 0x0F) | (((hi[i] >> (2 * t)) & 3) << 4)) - 32;
        return;
    }
    int scl, mn; /* Q4_K, Q5_K */
    gg_scale_min_k4(b + 4, j, &scl, &mn);
    sc->scale0 = sc->scale1 = gg_f16_scalar(b) * (float)scl;
    sc->min = -(gg_f16_scalar(b + 2) * (float)mn);
    const uint8_t *qs = b + (qt == GG_Q5_K ? 48 : 16) + 32 * (j >> 1);
    for (int i = 0; i < 32; i++) {
        w[i] = (qs[i] >> (4 * (j & 1))) & 0x0F;
        if (qt == GG_Q5_K) w[i] |= ((b[16 + i] >> j) & 1) << 4;
    }
}

/* Group g of one weight row: its 32 weights as gguf.quants.dequantize gives them. */
static inline void gg_group_scalar(const int qt, const uint8_t *row, int64_t g, float w[32]) {
    int q[32];
    gg_scales sc;
    gg_group_ints_scalar(qt, row, g, q, &sc);
    for (int i = 0; i < 32; i++) {
        w[i] = (i < 16 ? sc.scale0 : sc.scale1) * (float)q[i];
        if (gg_has_min(qt)) w[i] = w[i] + sc.min;
    }
}

/* gg_hsum's tree on eight lane sums. */
static inline float gg_hsum_scalar(const float a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* One output: row x (k values) against weight row w_row, in the AVX2 body's order. */
static inline float gg_dot_scalar(const int qt, const uint8_t *w_row, const float *x, int64_t k) {
    float acc[8] = {0};
    float w[32];
    for (int64_t g = 0; g < k / 32; g++) {
        gg_group_scalar(qt, w_row, g, w);
        for (int i = 0; i < 32; i++) acc[i & 7] = fmaf(x[g * 32 + i], w[i], acc[i & 7]);
    }
    return gg_hsum_scalar(acc);
}
#endif
