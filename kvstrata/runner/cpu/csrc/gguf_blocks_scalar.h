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

/* Group g of one weight row: its 32 weights as gguf.quants.dequantize gives them. */
static inline void gg_group_scalar(const int qt, const uint8_t *row, int64_t g, float w[32]) {
    if (qt == GG_Q4_0 || qt == GG_Q4_1 || qt == GG_Q5_0 || qt == GG_Q5_1 || qt == GG_Q8_0) {
        const uint8_t *b = row + g * gg_block_bytes(qt);
        const float d = gg_f16_scalar(b);
        if (qt == GG_Q8_0) {
            for (int i = 0; i < 32; i++) w[i] = (float)(int8_t)b[2 + i] * d;
            return;
        }
        const int with_min = qt == GG_Q4_1 || qt == GG_Q5_1, five = qt == GG_Q5_0 || qt == GG_Q5_1;
        const uint8_t *nibbles = b + 2 + 2 * with_min + 4 * five;
        uint32_t high = 0;
        if (five) memcpy(&high, nibbles - 4, 4);
        const float m = with_min ? gg_f16_scalar(b + 2) : 0.0f;
        for (int i = 0; i < 32; i++) {
            int q = (i < 16 ? nibbles[i] : nibbles[i - 16] >> 4) & 0x0F;
            q |= (int)((high >> i) & 1) << 4;
            w[i] = with_min ? d * (float)q + m : d * (float)(q - (five ? 16 : 8));
        }
        return;
    }
    const uint8_t *b = row + (g >> 3) * gg_block_bytes(qt);
    const int j = (int)(g & 7);
    if (qt == GG_Q6_K) {
        const int h = j >> 2, t = j & 3;
        const uint8_t *lo = b + 64 * h + 32 * (t & 1), *hi = b + 128 + 32 * h;
        const float d = gg_f16_scalar(b + 208);
        const float s0 = d * (float)(int8_t)b[192 + 2 * j];
        const float s1 = d * (float)(int8_t)b[192 + 2 * j + 1];
        for (int i = 0; i < 32; i++) {
            const int q = ((lo[i] >> (4 * (t >> 1))) & 0x0F) | (((hi[i] >> (2 * t)) & 3) << 4);
            w[i] = (i < 16 ? s0 : s1) * (float)(q - 32);
        }
        return;
    }
    /* Q4_K, Q5_K */
    int sc, mn;
    gg_scale_min_k4(b + 4, j, &sc, &mn);
    const float ds = gg_f16_scalar(b) * (float)sc, dm = gg_f16_scalar(b + 2) * (float)mn;
    const uint8_t *qs = b + (qt == GG_Q5_K ? 48 : 16) + 32 * (j >> 1);
    for (int i = 0; i < 32; i++) {
        int q = (qs[i] >> (4 * (j & 1))) & 0x0F;
        if (qt == GG_Q5_K) q |= ((b[16 + i] >> j) & 1) << 4;
        w[i] = ds * (float)q - dm;
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
