/* Vector pieces of the paged decode kernel (paged_decode.c), one set per instruction set:
 *
 *   load(dst, src, n)    n elements of a K/V row (fp32, bf16 or fp16) -> fp32
 *   dot(a, b, d)         sum a[i] * b[i] over fp32 vectors
 *   axpy(acc, p, x, d)   acc += p * x
 *   softmax(s, len, cap, sink)
 *                        s <- exp(s - m); returns the sum of the row's probabilities'
 *                        denominator. cap > 0: the scores are soft-capped first (Gemma 2:
 *                        s <- cap * tanh(s / cap), transformers' order: scale, cap, softmax);
 *                        sink (NULL: none): the head's learned sink logit (gpt-oss) joins the
 *                        max m and the sum but has no value, so its probability mass is
 *                        dropped from the weighted sum of V rows.
 *
 * The kernel converts each K/V row once into an fp32 scratch row (L1-resident) and runs the
 * fp32 dot/axpy over it, so the storage dtype and the arithmetic stay independent: a bf16 or
 * fp16 pool halves the bytes read from RAM (what bounds decode attention) while scores,
 * softmax and the weighted sum keep fp32 precision. Which set runs is decided per call at run
 * time from the CPU's flags (never at compile time: the same wheel runs on AVX2-only and
 * AVX-512 machines). Every set computes the same math; only the summation order differs. */
#ifndef KVSTRATA_PAGED_DECODE_ISA_H
#define KVSTRATA_PAGED_DECODE_ISA_H
#include "../../cpu/csrc/cpu_vec.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

typedef void (*load_fn)(float *, const void *, int64_t);
typedef float (*dot_fn)(const float *, const float *, int64_t);
typedef void (*axpy_fn)(float *, float, const float *, int64_t);
typedef float (*softmax_fn)(float *, int64_t, float, const float *);

/* ---- scalar ----------------------------------------------------------------------------- */
static void load_f32_scalar(float *dst, const void *src, int64_t n) { memcpy(dst, src, (size_t)n * 4); }
static void load_bf16_scalar(float *dst, const void *src, int64_t n) {
    const uint16_t *s = (const uint16_t *)src;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}
static void load_f16_scalar(float *dst, const void *src, int64_t n) {
    const uint16_t *s = (const uint16_t *)src;
    for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(s[i]);
}
static float dot_scalar(const float *a, const float *b, int64_t d) {
    float s = 0.f;
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}
static void axpy_scalar(float *acc, float p, const float *x, int64_t d) {
    for (int64_t i = 0; i < d; i++) acc[i] += p * x[i];
}
/* The extras of every ISA's softmax: the soft-cap in place (cap > 0), then the row's max
 * with the sink logit (if any) among the candidates. tanhf is per score, so a score's capped
 * value depends on that score alone (batch-invariant as the rest). */
static inline float softcap_max(float *s, int64_t len, float cap, const float *sink) {
    if (cap > 0.f)
        for (int64_t t = 0; t < len; t++) s[t] = tanhf(s[t] / cap) * cap;
    float m = sink ? *sink : s[0];
    for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
    return m;
}
static float softmax_scalar(float *s, int64_t len, float cap, const float *sink) {
    const float m = softcap_max(s, len, cap, sink);
    float sum = 0.f;
    for (int64_t t = 0; t < len; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
    return sink ? sum + expf(*sink - m) : sum;
}

#if defined(__x86_64__)
/* ---- AVX2 + FMA (+ F16C for fp16 rows); dot/axpy need d % 8 == 0 ------------------------- */
AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
AVX2 static void load_bf16_avx2(float *dst, const void *src, int64_t n) {
    const uint16_t *s = (const uint16_t *)src;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}
AVX2 static void load_f16_avx2(float *dst, const void *src, int64_t n) {
    const uint16_t *s = (const uint16_t *)src;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++) dst[i] = f16_to_f32(s[i]);
}
AVX2 static float dot_avx2(const float *a, const float *b, int64_t d) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i < d; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    return hsum256(_mm256_add_ps(s0, s1));
}
AVX2 static void axpy_avx2(float *acc, float p, const float *x, int64_t d) {
    __m256 pv = _mm256_set1_ps(p);
    for (int64_t i = 0; i < d; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i),
                                                 _mm256_loadu_ps(acc + i)));
}
AVX2 static float softmax_avx2(float *s, int64_t len, float cap, const float *sink) {
    const float m = softcap_max(s, len, cap, sink);
    __m256 mv = _mm256_set1_ps(m), sum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        __m256 e = exp_nonpos_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum256(sum);
    for (; t < len; t++) { s[t] = expf(s[t] - m); total += s[t]; }
    return sink ? total + expf(*sink - m) : total;
}

/* ---- AVX-512 F (16 floats a vector); dot/axpy need d % 16 == 0 --------------------------- */
AVX512 static void load_bf16_avx512(float *dst, const void *src, int64_t n) {
    const uint16_t *s = (const uint16_t *)src;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, bf16x16_load(s + i));
    for (; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}
AVX512 static void load_f16_avx512(float *dst, const void *src, int64_t n) {
    const uint16_t *s = (const uint16_t *)src;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + i))));
    for (; i < n; i++) dst[i] = f16_to_f32(s[i]);
}
AVX512 static float dot_avx512(const float *a, const float *b, int64_t d) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    for (; i < d; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}
AVX512 static void axpy_avx512(float *acc, float p, const float *x, int64_t d) {
    __m512 pv = _mm512_set1_ps(p);
    for (int64_t i = 0; i < d; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + i),
                                                 _mm512_loadu_ps(acc + i)));
}
#endif

typedef struct {
    load_fn load;
    dot_fn dot;
    axpy_fn axpy;
    softmax_fn softmax;
    int isa;
} kernels;

static const char *const ISA_NAMES[] = {"scalar", "avx2", "avx512"};

/* The widest set this CPU runs for head size d and row dtype, at most `cap`. */
static kernels pick_kernels(int64_t d, int dtype, int cap) {
    kernels k = {load_f32_scalar, dot_scalar, axpy_scalar, softmax_scalar, ISA_SCALAR};
    if (dtype == KV_BF16) k.load = load_bf16_scalar;
    if (dtype == KV_F16) k.load = load_f16_scalar;
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    if (cap >= ISA_AVX512 && d % 16 == 0 && avx2 && __builtin_cpu_supports("avx512f")) {
        k.dot = dot_avx512; k.axpy = axpy_avx512; k.softmax = softmax_avx2;
        if (dtype == KV_BF16) k.load = load_bf16_avx512;
        if (dtype == KV_F16) k.load = load_f16_avx512;
        k.isa = ISA_AVX512;
    } else if (cap >= ISA_AVX2 && d % 8 == 0 && avx2) {
        k.dot = dot_avx2; k.axpy = axpy_avx2; k.softmax = softmax_avx2;
        if (dtype == KV_BF16) k.load = load_bf16_avx2;
        if (dtype == KV_F16) k.load = load_f16_avx2;
        k.isa = ISA_AVX2;
    }
#else
    (void)d; (void)cap;
#endif
    return k;
}
#endif
