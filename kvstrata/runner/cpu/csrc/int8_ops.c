/* The element-wise halves of `--quantization w8a8_int8` on a VNNI CPU
 * (kvstrata/runner/cpu/int8_linear.py wraps them; the int8 GEMM between them is oneDNN's).
 *
 *   quant_rows(x, x_row_stride, rows, k, dtype, q, scales, threads, isa_cap)
 *       per token (row) r: a = max |x[r]|, scales[r] = a / 127 (a == 0: 1e-12 / 127),
 *       q[r, i] = 128 + round_half_even(x[r, i] * 127 / a), in [1, 255] (uint8 with zero
 *       point 128, contiguous): the symmetric int8 code, as the u8 the GEMM takes
 *   dequant_rows(y, rows, n, x_scales, bias, out, dtype, threads, isa_cap)
 *       out[r, j] = y[r, j] * x_scales[r] (+ bias[j]), fp32 or bf16 (round to nearest
 *       even); y fp32 [rows, n] contiguous (the GEMM's acc * w_scale); bias 0 for none
 *   dequant_silu_mul(y, rows, n, x_scales, bias, out, dtype, threads, isa_cap)
 *       y [rows, 2n] of a fused gate|up projection: g and u dequantised as above (rounded to
 *       dtype), then out[r, j] = silu(g) * u as runner/cpu/csrc/cpu_ops.c silu_mul computes it
 *       (bf16: bf16(bf16(silu(g)) * u)): dequant_rows then silu_mul in one pass, the same
 *       values, without writing and reading back the [rows, 2n] activation
 *
 * x is fp32 or bf16 (dtype 0 / 1), its rows may be strided, elements contiguous. The scalar
 * path computes the same values as the AVX-512 and AVX2 ones (the same fp32 operations in
 * the same order; the products are never fused: built with -ffp-contract=off), so a token's result
 * does not depend on the ISA, on the batch it is in or on the thread count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "cpu_rows.h"
#include "cpu_vec.h"

#define LEVELS 127.f
#define MIN_AMAX 1e-12f
enum { F32 = 0, BF16 = 1 };

static inline float load_f(const void *x, int64_t i, int dtype) {
    return dtype == F32 ? ((const float *)x)[i] : bf16_to_f32(((const uint16_t *)x)[i]);
}

/* ---- one row, scalar -------------------------------------------------------------------- */
static void quant_row_scalar(const void *x, int64_t k, int dtype, uint8_t *q, float *scale) {
    float amax = 0.f;
    for (int64_t i = 0; i < k; i++) amax = fmaxf(amax, fabsf(load_f(x, i, dtype)));
    amax = fmaxf(amax, MIN_AMAX);
    const float inv = LEVELS / amax;
    for (int64_t i = 0; i < k; i++) {
        float v = nearbyintf(load_f(x, i, dtype) * inv); /* default mode: half to even */
        q[i] = (uint8_t)(128 + (int)fminf(fmaxf(v, -LEVELS), LEVELS));
    }
    *scale = amax / LEVELS;
}
static void dequant_row_scalar(const float *y, int64_t n, float xs, const float *bias,
                               void *out, int dtype) {
    for (int64_t j = 0; j < n; j++) {
        float v = y[j] * xs;
        if (bias) v += bias[j];
        if (dtype == F32) ((float *)out)[j] = v;
        else ((uint16_t *)out)[j] = f32_to_bf16(v);
    }
}

static inline float round_to(float v, int dtype) {
    return dtype == F32 ? v : bf16_to_f32(f32_to_bf16(v));
}
static void dequant_silu_row_scalar(const float *y, int64_t n, float xs, const float *bias,
                                    void *out, int dtype) {
    for (int64_t j = 0; j < n; j++) {
        float g = y[j] * xs, u = y[n + j] * xs;
        if (bias) { g += bias[j]; u += bias[n + j]; }
        g = round_to(g, dtype);
        u = round_to(u, dtype);
        if (dtype == F32) ((float *)out)[j] = silu_f(g) * u;
        else ((uint16_t *)out)[j] = f32_to_bf16(round_to(silu_f(g), dtype) * u);
    }
}

/* ---- one row, AVX-512F (k % 16 == 0 / n % 16 == 0) -------------------------------------- */
#if defined(__x86_64__)
AVX512 static inline __m512 load16(const void *x, int64_t i, int dtype) {
    return dtype == F32 ? _mm512_loadu_ps((const float *)x + i)
                        : bf16x16_load((const uint16_t *)x + i);
}
AVX512 static void quant_row_avx512(const void *x, int64_t k, int dtype, uint8_t *q,
                                    float *scale) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(x, i, dtype)));
    const float amax = fmaxf(_mm512_reduce_max_ps(m), MIN_AMAX);
    const __m512 inv = _mm512_set1_ps(LEVELS / amax);
    for (int64_t i = 0; i < k; i += 16) {
        /* cvtps rounds half to even (MXCSR default); |v| <= 127 after the scale, and the
         * saturating narrow keeps any rounding excess inside int8. */
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, i, dtype), inv));
        v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(v, _mm512_set1_epi32(128))));
    }
    *scale = amax / LEVELS;
}
AVX512 static void dequant_row_avx512(const float *y, int64_t n, float xs, const float *bias,
                                      void *out, int dtype) {
    const __m512 s = _mm512_set1_ps(xs);
    for (int64_t j = 0; j < n; j += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(y + j), s);
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
        if (dtype == F32) _mm512_storeu_ps((float *)out + j, v);
        else _mm256_storeu_si256((__m256i *)((uint16_t *)out + j), bf16x16_from(v));
    }
}
AVX512 static void dequant_silu_row_avx512(const float *y, int64_t n, float xs,
                                           const float *bias, void *out, int dtype) {
    const __m512 s = _mm512_set1_ps(xs);
    for (int64_t j = 0; j < n; j += 16) {
        __m512 g = _mm512_mul_ps(_mm512_loadu_ps(y + j), s);
        __m512 u = _mm512_mul_ps(_mm512_loadu_ps(y + n + j), s);
        if (bias) {
            g = _mm512_add_ps(g, _mm512_loadu_ps(bias + j));
            u = _mm512_add_ps(u, _mm512_loadu_ps(bias + n + j));
        }
        if (dtype == F32) {
            _mm512_storeu_ps((float *)out + j, _mm512_mul_ps(silu_v(g), u));
        } else {
            __m512 a = bf16x16_round(silu_v(bf16x16_round(g)));
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + j),
                                bf16x16_from(_mm512_mul_ps(a, bf16x16_round(u))));
        }
    }
}
#endif

/* ---- one row, AVX2 (k % 8 == 0): quant_row_scalar's values (max is exact; cvtps rounds
 * half to even as nearbyintf does; |v| <= 127 after the scale) ---------------------------- */
#if defined(__x86_64__)
AVX2 static inline __m256 load8(const void *x, int64_t i, int dtype) {
    return dtype == F32 ? _mm256_loadu_ps((const float *)x + i)
                        : bf16x8_load((const uint16_t *)x + i);
}
AVX2 static void quant_row_avx2(const void *x, int64_t k, int dtype, uint8_t *q, float *scale) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8)
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, load8(x, i, dtype)));
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float amax = MIN_AMAX;
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, lanes[i]);
    const __m256 inv = _mm256_set1_ps(LEVELS / amax);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    for (int64_t i = 0; i < k; i += 8) {
        __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, i, dtype), inv));
        v = _mm256_add_epi32(_mm256_max_epi32(_mm256_min_epi32(v, hi), lo),
                             _mm256_set1_epi32(128));
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v),
                                          _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packus_epi16(w, w)); /* [1, 255]: exact */
    }
    *scale = amax / LEVELS;
}
/* dequant_silu_row_scalar's dequantisation, then cpu_ops.c silu_row_avx2's silu (silu_v8):
 * where n % 16 != 0 but n % 8 == 0, cpu_ops.c silu_mul runs that 8-lane silu, not expf, so the
 * fused call must too to give its values (an AMX box found the scalar tail off by ulps). */
AVX2 static void dequant_silu_row_avx2(const float *y, int64_t n, float xs, const float *bias,
                                       void *out, int dtype) {
    const __m256 s = _mm256_set1_ps(xs);
    for (int64_t j = 0; j < n; j += 8) {
        __m256 g = _mm256_mul_ps(_mm256_loadu_ps(y + j), s);
        __m256 u = _mm256_mul_ps(_mm256_loadu_ps(y + n + j), s);
        if (bias) {
            g = _mm256_add_ps(g, _mm256_loadu_ps(bias + j));
            u = _mm256_add_ps(u, _mm256_loadu_ps(bias + n + j));
        }
        if (dtype == F32) {
            _mm256_storeu_ps((float *)out + j, _mm256_mul_ps(silu_v8(g), u));
        } else {
            __m256 a = bf16x8_round(silu_v8(bf16x8_round(g)));
            _mm_storeu_si128((__m128i *)((uint16_t *)out + j),
                             bf16x8_from(_mm256_mul_ps(a, bf16x8_round(u))));
        }
    }
}
#endif

/* The row quantiser for rows of k: 2 = AVX-512F, 1 = AVX2, 0 = scalar (the same values). */
static int quant_isa(int64_t k, int isa_cap) {
    return use_avx512(k, isa_cap) ? 2 : use_avx2(k, isa_cap);
}

/* Row r of x (rows `stride` elements apart) into q[r * k ..] and scales[r], on the path
 * `vec` (quant_isa) picks: quant_rows and linear both call it. */
static void quant_row(const char *x, int64_t stride, int64_t r, int64_t k, int dtype, int vec,
                      uint8_t *q, float *scales) {
    const char *xr = x + r * stride * (dtype == F32 ? 4 : 2);
#if defined(__x86_64__)
    if (vec == 2) { quant_row_avx512(xr, k, dtype, q + r * k, scales + r); return; }
    if (vec == 1) { quant_row_avx2(xr, k, dtype, q + r * k, scales + r); return; }
#endif
    (void)vec;
    quant_row_scalar(xr, k, dtype, q + r * k, scales + r);
}

static PyObject *quant_rows(PyObject *self, PyObject *args) {
    unsigned long long x_addr, q_addr, s_addr;
    Py_ssize_t stride, rows, k;
    int dtype, threads, isa_cap;
    if (!PyArg_ParseTuple(args, "KnnniKKii", &x_addr, &stride, &rows, &k, &dtype, &q_addr,
                          &s_addr, &threads, &isa_cap))
        return NULL;
    if (rows < 0 || k < 1 || stride < k || (dtype != F32 && dtype != BF16)) {
        PyErr_Format(PyExc_ValueError, "bad shape or dtype: rows=%zd k=%zd stride=%zd dtype=%d",
                     rows, k, stride, dtype);
        return NULL;
    }
    const int64_t esz = dtype == F32 ? 4 : 2;
    const char *x = (const char *)x_addr;
    uint8_t *q = (uint8_t *)q_addr;
    float *scales = (float *)s_addr;
    const int vec = quant_isa(k, isa_cap);
    const int nt = thread_count(threads, rows, (int64_t)rows * k * (esz + 1));
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (Py_ssize_t r = 0; r < rows; r++) quant_row(x, stride, r, k, dtype, vec, q, scales);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* dequant_rows (silu = 0: y [rows, n]) and dequant_silu_mul (silu = 1: y [rows, 2n]). */
static PyObject *dequant_entry(PyObject *args, int silu) {
    unsigned long long y_addr, xs_addr, b_addr, o_addr;
    Py_ssize_t rows, n;
    int dtype, threads, isa_cap;
    if (!PyArg_ParseTuple(args, "KnnKKKiii", &y_addr, &rows, &n, &xs_addr, &b_addr, &o_addr,
                          &dtype, &threads, &isa_cap))
        return NULL;
    if (rows < 0 || n < 1 || (dtype != F32 && dtype != BF16)) {
        PyErr_Format(PyExc_ValueError, "bad shape or dtype: rows=%zd n=%zd dtype=%d", rows, n,
                     dtype);
        return NULL;
    }
    const int64_t esz = dtype == F32 ? 4 : 2, y_row = silu ? 2 * n : n;
    const float *y = (const float *)y_addr, *xs = (const float *)xs_addr;
    const float *bias = (const float *)b_addr;
    char *out = (char *)o_addr;
    /* silu: the path cpu_ops.c silu_mul takes for n (AVX-512, AVX2 or scalar) */
    const int vec = use_avx512(n, isa_cap), vec8 = silu && !vec && use_avx2(n, isa_cap);
    const int nt = thread_count(threads, rows, (int64_t)rows * (y_row * 4 + n * esz));
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *yr = y + r * y_row;
        void *o = out + r * n * esz;
#if defined(__x86_64__)
        if (vec) {
            if (silu) dequant_silu_row_avx512(yr, n, xs[r], bias, o, dtype);
            else dequant_row_avx512(yr, n, xs[r], bias, o, dtype);
            continue;
        }
        if (vec8) { dequant_silu_row_avx2(yr, n, xs[r], bias, o, dtype); continue; }
#endif
        if (silu) dequant_silu_row_scalar(yr, n, xs[r], bias, o, dtype);
        else dequant_row_scalar(yr, n, xs[r], bias, o, dtype);
    }
    Py_END_ALLOW_THREADS
    (void)vec, (void)vec8;
    Py_RETURN_NONE;
}
static PyObject *dequant_rows(PyObject *self, PyObject *args) { return dequant_entry(args, 0); }
static PyObject *dequant_silu_mul(PyObject *self, PyObject *args) {
    return dequant_entry(args, 1);
}

#include "side_rows.h"
#include "int8_gemm.h"

/* linear(x, x_row_stride, rows, k, dtype, w, n, comp, w_scales, bias, out, silu, threads,
 *        isa_cap): quant_rows, the int8 GEMM of int8_gemm.h and dequant_rows (silu = 0: out
 * [rows, n]) or dequant_silu_mul (silu = 1: out [rows, n / 2]) in one call; the same values
 * as those steps around oneDNN's GEMM. k % 4 == 0, n % 16 (silu: 32) == 0. */
static PyObject *linear_impl(PyObject *args, int emulate_amx) {
    unsigned long long x_addr, w_addr, c_addr, ws_addr, b_addr, o_addr;
    Py_ssize_t stride, rows, k, n;
    int dtype, silu, threads, isa_cap;
    /* this call's side rows, if its caller set one: taken first, so no job outlives a call
     * that fails (its slot list may be gone by the next) */
    const side_rows job = take_side_rows();
    if (!PyArg_ParseTuple(args, "KnnniKnKKKKiii", &x_addr, &stride, &rows, &k, &dtype, &w_addr,
                          &n, &c_addr, &ws_addr, &b_addr, &o_addr, &silu, &threads, &isa_cap))
        return NULL;
    if (rows < 0 || k < 4 || k % 4 || stride < k || n < BLOCK || n % (silu ? 2 * BLOCK : BLOCK)
        || (dtype != F32 && dtype != BF16)) {
        PyErr_Format(PyExc_ValueError, "bad shape or dtype: rows=%zd k=%zd n=%zd stride=%zd "
                     "dtype=%d silu=%d", rows, k, n, stride, dtype, silu);
        return NULL;
    }
    int isa = gemm_isa(isa_cap);
    /* AMX tiles (or their emulation: tests) above MR rows, k % 64 == 0; else the VNNI tile */
    int amx = 0;
#ifdef KVSTRATA_AMX
    if (emulate_amx && k % AMX_K) {
        PyErr_SetString(PyExc_ValueError, "the emulated AMX tiles need k % 64 == 0");
        return NULL;
    }
    amx = emulate_amx || (isa == 3 && k % AMX_K == 0 && rows > MR);
#else
    if (emulate_amx) {
        PyErr_SetString(PyExc_RuntimeError, "built without the AMX body (x86-64 Linux only)");
        return NULL;
    }
#endif
    if (isa == 3) isa = 2;
    const int64_t pad = amx ? 16 : MR; /* rows padded to a multiple of this (code 128) */
    const int64_t mp = (rows + pad - 1) / pad * pad;
    uint8_t *qa = aligned_alloc(64, (size_t)((mp * k + 63) / 64 * 64 + 64));
    float *xs = malloc(sizeof(float) * (size_t)(mp + 1));
    if (!qa || !xs) {
        free(qa);
        free(xs);
        return PyErr_NoMemory();
    }
    gemm_args g = {qa, xs, (const int8_t *)w_addr, (const int32_t *)c_addr,
                   (const float *)ws_addr, (const float *)b_addr, (char *)o_addr, rows, k, n,
                   dtype, silu != 0};
    const char *x = (const char *)x_addr;
    const int qvec = quant_isa(k, isa_cap);
    int64_t items = panel_count(g.n, g.silu) * (mp / MR);
#ifdef KVSTRATA_AMX
    if (amx) items = amx_panel_count(g.n, g.silu) * ((rows + AMX_ITEM_ROWS - 1) / AMX_ITEM_ROWS);
#endif
    const int nt = thread_count(threads, items, (int64_t)n * k);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < mp; r++) {
            if (r >= rows) { memset(qa + r * k, 128, (size_t)k); xs[r] = 0.f; continue; }
            quant_row(x, stride, r, k, dtype, qvec, qa, xs);
        }
#ifdef KVSTRATA_AMX
        /* emulated: the VNNI epilogue where that tile runs (the tiles' own), else scalar */
        if (amx) amx_gemm_tiles(&g, emulate_amx ? (isa == 2 ? AMX_EMU_512 : AMX_EMU) : AMX_HW);
        else
#endif
            gemm_tiles(&g, mp, isa, &job);
    }
    Py_END_ALLOW_THREADS
    free(qa);
    free(xs);
    Py_RETURN_NONE;
}

static PyObject *linear(PyObject *self, PyObject *args) { return linear_impl(args, 0); }
static PyObject *linear_amx_emulated(PyObject *self, PyObject *args) {
    return linear_impl(args, 1);
}

static PyObject *kernel_isa(PyObject *self, PyObject *args) {
    int isa_cap;
    if (!PyArg_ParseTuple(args, "i", &isa_cap)) return NULL;
    return PyLong_FromLong(gemm_isa(isa_cap));
}

static PyMethodDef methods[] = {
    {"quant_rows", quant_rows, METH_VARARGS, "Per-token symmetric int8 quantisation of rows."},
    {"dequant_rows", dequant_rows, METH_VARARGS, "GEMM rows (acc * w_scale) times token scales, plus bias."},
    {"linear", linear, METH_VARARGS, "Quantise rows, int8 GEMM (VNNI / AVX2 / scalar), dequantise: one call."},
    {"linear_amx_emulated", linear_amx_emulated, METH_VARARGS,
     "linear's arguments, the GEMM on int8_gemm_amx.h's tiles emulated in memory (tests)."},
    {"kernel_isa", kernel_isa, METH_VARARGS,
     "What linear multiplies with: 3 AMX-INT8 (cap 3), 2 VNNI, 1 AVX2, 0 scalar."},
    {"dequant_silu_mul", dequant_silu_mul, METH_VARARGS, "dequant_rows of a gate|up projection, then silu(gate) * up."},
    SIDE_ROWS_METHODS
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int8_ops",
                                    "Quantise / dequantise rows around an int8 GEMM.", -1, methods};

PyMODINIT_FUNC PyInit__int8_ops(void) { return PyModule_Create(&module); }
