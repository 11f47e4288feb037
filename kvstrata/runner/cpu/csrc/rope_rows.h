/* cpu_ops.c's rope rows: each of the first `heads` d-wide heads of one row rotated in place
 * (cos/sin rows of d; sin's first half negated), HF's roundings -- bf16: each product rounded,
 * then the sum; fp32: two products and a sum, never an FMA (-ffp-contract=off). Included by
 * cpu_ops.c after cpu_rows.h / cpu_vec.h and its F32 / BF16 dtype codes. */
#ifndef KVSTRATA_ROPE_ROWS_H
#define KVSTRATA_ROPE_ROWS_H

static void rope_row_scalar(void *x, const void *c, const void *s, int64_t heads, int64_t d,
                            int dtype) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        if (dtype == F32) {
            float *v = (float *)x + h * d;
            const float *cf = (const float *)c, *sf = (const float *)s;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                const float ac = a * cf[i], bs = b * sf[i], bc = b * cf[i + half],
                            as = a * sf[i + half];
                v[i] = ac + bs;
                v[i + half] = bc + as;
            }
        } else {
            uint16_t *v = (uint16_t *)x + h * d;
            const uint16_t *cb = (const uint16_t *)c, *sb = (const uint16_t *)s;
            for (int64_t i = 0; i < half; i++) {
                const float a = bf16_to_f32(v[i]), b = bf16_to_f32(v[i + half]);
                const float ac = bf16_to_f32(f32_to_bf16(a * bf16_to_f32(cb[i])));
                const float bs = bf16_to_f32(f32_to_bf16(b * bf16_to_f32(sb[i])));
                const float bc = bf16_to_f32(f32_to_bf16(b * bf16_to_f32(cb[i + half])));
                const float as = bf16_to_f32(f32_to_bf16(a * bf16_to_f32(sb[i + half])));
                v[i] = f32_to_bf16(ac + bs);
                v[i + half] = f32_to_bf16(bc + as);
            }
        }
    }
}
#if defined(__x86_64__)
/* half % 16 == 0 */
AVX512 static void rope_row_avx512(void *x, const void *c, const void *s, int64_t heads,
                                   int64_t d, int dtype) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t i = 0; i < half; i += 16) {
            __m512 a, b, c0, c1, s0, s1;
            if (dtype == F32) {
                float *v = (float *)x + h * d;
                a = _mm512_loadu_ps(v + i); b = _mm512_loadu_ps(v + i + half);
                c0 = _mm512_loadu_ps((const float *)c + i);
                c1 = _mm512_loadu_ps((const float *)c + i + half);
                s0 = _mm512_loadu_ps((const float *)s + i);
                s1 = _mm512_loadu_ps((const float *)s + i + half);
                _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_mul_ps(a, c0), _mm512_mul_ps(b, s0)));
                _mm512_storeu_ps(v + i + half, _mm512_add_ps(_mm512_mul_ps(b, c1), _mm512_mul_ps(a, s1)));
            } else {
                uint16_t *v = (uint16_t *)x + h * d;
                a = bf16x16_load(v + i); b = bf16x16_load(v + i + half);
                c0 = bf16x16_load((const uint16_t *)c + i);
                c1 = bf16x16_load((const uint16_t *)c + i + half);
                s0 = bf16x16_load((const uint16_t *)s + i);
                s1 = bf16x16_load((const uint16_t *)s + i + half);
                __m512 lo = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(a, c0)),
                                          bf16x16_round(_mm512_mul_ps(b, s0)));
                __m512 hi = _mm512_add_ps(bf16x16_round(_mm512_mul_ps(b, c1)),
                                          bf16x16_round(_mm512_mul_ps(a, s1)));
                _mm256_storeu_si256((__m256i *)(v + i), bf16x16_from(lo));
                _mm256_storeu_si256((__m256i *)(v + i + half), bf16x16_from(hi));
            }
        }
}
/* The same at AVX2 width (half % 8 == 0), the same roundings. */
AVX2 static void rope_row_avx2(void *x, const void *c, const void *s, int64_t heads, int64_t d,
                               int dtype) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t i = 0; i < half; i += 8) {
            if (dtype == F32) {
                float *v = (float *)x + h * d;
                const float *cf = (const float *)c, *sf = (const float *)s;
                const __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + i + half);
                _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(cf + i)),
                                                      _mm256_mul_ps(b, _mm256_loadu_ps(sf + i))));
                _mm256_storeu_ps(v + i + half,
                                 _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cf + i + half)),
                                               _mm256_mul_ps(a, _mm256_loadu_ps(sf + i + half))));
            } else {
                uint16_t *v = (uint16_t *)x + h * d;
                const uint16_t *cb = (const uint16_t *)c, *sb = (const uint16_t *)s;
                const __m256 a = bf16x8_load(v + i), b = bf16x8_load(v + i + half);
                const __m256 lo = _mm256_add_ps(bf16x8_round(_mm256_mul_ps(a, bf16x8_load(cb + i))),
                                                bf16x8_round(_mm256_mul_ps(b, bf16x8_load(sb + i))));
                const __m256 hi = _mm256_add_ps(
                    bf16x8_round(_mm256_mul_ps(b, bf16x8_load(cb + i + half))),
                    bf16x8_round(_mm256_mul_ps(a, bf16x8_load(sb + i + half))));
                _mm_storeu_si128((__m128i *)(v + i), bf16x8_from(lo));
                _mm_storeu_si128((__m128i *)(v + i + half), bf16x8_from(hi));
            }
        }
}
#endif
#endif
