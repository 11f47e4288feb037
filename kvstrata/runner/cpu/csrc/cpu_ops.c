/* Fused element-wise ops of the llama-family decoder on the CPU (kvstrata/runner/cpu/fused_ops.py
 * wraps them; see there for when they run and what they replace).
 *
 *   rms_norm_bf16(x, x_row_stride, rows, h, w, out, eps, threads, isa_cap)
 *       out[r] = bf16(w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)))   (HF's two roundings)
 *   silu_mul(x, x_row_stride, rows, inter, out, dtype, threads, isa_cap)
 *       out[r] = silu(x[r, :inter]) * x[r, inter:2*inter]; bf16: bf16(bf16(silu(g)) * u)
 *   add_rms_norm_bf16(x, y, rows, h, w, out, eps, threads, isa_cap)
 *       x[r] = bf16(x[r] + y[r]) in place, then out[r] = rms_norm(x[r]) as above (x, y, out
 *       contiguous [rows, h]): a residual add and the next norm in one pass
 *   rope(x, x_row_stride, rows, heads, d, cos, sin, dtype, threads, isa_cap)
 *       each of the first `heads` d-wide heads of row r rotated in place:
 *       x[i] = x[i] * cos[r, i] + x[(i + d/2) % d] * sin[r, i]   (sin's first half negated:
 *       rope.py cos_sin), HF's roundings (bf16: each product rounded, then the sum; fp32: two
 *       products and a sum, never fused into an FMA: built with -ffp-contract=off)
 *   shm_all_reduce(...)   one rank's step of the shared-memory all-reduce (see below)
 *   argmax_rows(...)      the greedy token of each row of fp32 logits (argmax_rows.h)
 *   rms_norm_f32, add_rms_norm_f32(...)   the norms above for fp32 (rms_f32_rows.h)
 *   gemv_f32(...)         fp32 linear of 1-16 rows over panel-packed weights (f32_gemv.h)
 *
 * x rows may be strided (a view), their elements contiguous; out is contiguous. Every
 * intermediate is fp32, rounded to bf16 where torch's unfused ops round (round to nearest
 * even), so the result equals the op sequence it replaces up to fp32 summation order and the
 * exp approximation (< 2e-7 relative). Vector code (AVX-512F; the norms, silu_mul, rope and
 * argmax also AVX2 + FMA, silu shared with bf16_gemm.c's AVX2 epilogue) is chosen at run time; the
 * scalar path computes the same. Rows are split across OpenMP threads (torch's own team, as
 * in attention/csrc/paged_decode.c) above a size where the fork pays.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "cpu_rows.h"
#include "cpu_vec.h"

enum { F32 = 0, BF16 = 1 };


/* ---- scalar rows ------------------------------------------------------------------------ */
static void rms_row_scalar(const uint16_t *x, const uint16_t *w, uint16_t *o, int64_t h,
                           float eps) {
    float ss = 0.f;
    for (int64_t i = 0; i < h; i++) { float v = bf16_to_f32(x[i]); ss += v * v; }
    const float r = 1.f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) o[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * r)));
}
static void silu_row_scalar(const void *x, void *o, int64_t n, int dtype) {
    if (dtype == F32) {
        const float *g = (const float *)x, *u = g + n;
        float *out = (float *)o;
        for (int64_t i = 0; i < n; i++) out[i] = silu_f(g[i]) * u[i];
    } else {
        const uint16_t *g = (const uint16_t *)x, *u = g + n;
        uint16_t *out = (uint16_t *)o;
        for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu_f(bf16_to_f32(g[i])))) * bf16_to_f32(u[i]));
    }
}

/* ---- AVX-512F rows (h % 16 == 0 / n % 16 == 0) ------------------------------------------ */
#if defined(__x86_64__)
AVX512 static void rms_row_avx512(const uint16_t *x, const uint16_t *w, uint16_t *o,
                                  int64_t h, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) { __m512 v = bf16x16_load(x + i); ss = _mm512_fmadd_ps(v, v, ss); }
    const __m512 r = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)h + eps));
    for (int64_t i = 0; i < h; i += 16) {
        __m512 n = bf16x16_round(_mm512_mul_ps(bf16x16_load(x + i), r));
        _mm256_storeu_si256((__m256i *)(o + i), bf16x16_from(_mm512_mul_ps(bf16x16_load(w + i), n)));
    }
}
AVX512 static void silu_row_avx512(const void *x, void *o, int64_t n, int dtype) {
    if (dtype == F32) {
        const float *g = (const float *)x, *u = g + n;
        float *out = (float *)o;
        for (int64_t i = 0; i < n; i += 16)
            _mm512_storeu_ps(out + i, _mm512_mul_ps(silu_v(_mm512_loadu_ps(g + i)),
                                                    _mm512_loadu_ps(u + i)));
    } else {
        const uint16_t *g = (const uint16_t *)x, *u = g + n;
        uint16_t *out = (uint16_t *)o;
        for (int64_t i = 0; i < n; i += 16)
            _mm256_storeu_si256((__m256i *)(out + i),
                                bf16x16_from(_mm512_mul_ps(bf16x16_round(silu_v(bf16x16_load(g + i))), bf16x16_load(u + i))));
    }
}
#endif

/* ---- AVX2 + FMA rows (widths % 8 == 0): the AVX-512 rows' arithmetic, 8 lanes ---------- */
#if defined(__x86_64__)
AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* The normalised row from its sum of squares (rms_row_avx2 and add_rms_row_avx2). */
AVX2 static void rms_scale_avx2(const uint16_t *x, const uint16_t *w, uint16_t *o, int64_t h,
                                float ss, float eps) {
    const __m256 r = _mm256_set1_ps(1.f / sqrtf(ss / (float)h + eps));
    for (int64_t i = 0; i < h; i += 8) {
        __m256 n = bf16x8_round(_mm256_mul_ps(bf16x8_load(x + i), r));
        _mm_storeu_si128((__m128i *)(o + i), bf16x8_from(_mm256_mul_ps(bf16x8_load(w + i), n)));
    }
}
AVX2 static void rms_row_avx2(const uint16_t *x, const uint16_t *w, uint16_t *o, int64_t h,
                              float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < h; i += 8) { __m256 v = bf16x8_load(x + i); ss = _mm256_fmadd_ps(v, v, ss); }
    rms_scale_avx2(x, w, o, h, hsum8(ss), eps);
}
AVX2 static void add_rms_row_avx2(uint16_t *x, const uint16_t *y, const uint16_t *w,
                                  uint16_t *o, int64_t h, float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < h; i += 8) {
        __m256 v = bf16x8_round(_mm256_add_ps(bf16x8_load(x + i), bf16x8_load(y + i)));
        _mm_storeu_si128((__m128i *)(x + i), bf16x8_from(v));
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    rms_scale_avx2(x, w, o, h, hsum8(ss), eps);
}
AVX2 static void silu_row_avx2(const void *x, void *o, int64_t n, int dtype) {
    if (dtype == F32) {
        const float *g = (const float *)x, *u = g + n;
        float *out = (float *)o;
        for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(silu_v8(_mm256_loadu_ps(g + i)),
                                                    _mm256_loadu_ps(u + i)));
    } else {
        const uint16_t *g = (const uint16_t *)x, *u = g + n;
        uint16_t *out = (uint16_t *)o;
        for (int64_t i = 0; i < n; i += 8)
            _mm_storeu_si128((__m128i *)(out + i),
                             bf16x8_from(_mm256_mul_ps(bf16x8_round(silu_v8(bf16x8_load(g + i))),
                                                       bf16x8_load(u + i))));
    }
}
#endif

#include "rope_rows.h"

static void add_rms_row_scalar(uint16_t *x, const uint16_t *y, const uint16_t *w, uint16_t *o,
                               int64_t h, float eps) {
    for (int64_t i = 0; i < h; i++) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
    rms_row_scalar(x, w, o, h, eps);
}
#if defined(__x86_64__)
AVX512 static void add_rms_row_avx512(uint16_t *x, const uint16_t *y, const uint16_t *w,
                                      uint16_t *o, int64_t h, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
        __m256i sum = bf16x16_from(_mm512_add_ps(bf16x16_load(x + i), bf16x16_load(y + i)));
        _mm256_storeu_si256((__m256i *)(x + i), sum);
        __m512 v = bf16x16_load(x + i);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 r = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)h + eps));
    for (int64_t i = 0; i < h; i += 16) {
        __m512 n = bf16x16_round(_mm512_mul_ps(bf16x16_load(x + i), r));
        _mm256_storeu_si256((__m256i *)(o + i), bf16x16_from(_mm512_mul_ps(bf16x16_load(w + i), n)));
    }
}
#endif

static PyObject *rms_norm_bf16(PyObject *self, PyObject *args) {
    unsigned long long x_addr, w_addr, o_addr;
    Py_ssize_t stride, rows, h;
    double eps;
    int threads, isa_cap;
    if (!PyArg_ParseTuple(args, "KnnnKKdii", &x_addr, &stride, &rows, &h, &w_addr, &o_addr,
                          &eps, &threads, &isa_cap))
        return NULL;
    if (rows < 0 || h < 1 || stride < h) {
        PyErr_Format(PyExc_ValueError, "bad shape: rows=%zd h=%zd stride=%zd", rows, h, stride);
        return NULL;
    }
    const uint16_t *x = (const uint16_t *)x_addr, *w = (const uint16_t *)w_addr;
    uint16_t *o = (uint16_t *)o_addr;
    const int vec = use_avx512(h, isa_cap), vec8 = !vec && use_avx2(h, isa_cap);
    const int nt = thread_count(threads, rows, (int64_t)rows * h * 2);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (Py_ssize_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (vec) { rms_row_avx512(x + r * stride, w, o + r * h, h, (float)eps); continue; }
        if (vec8) { rms_row_avx2(x + r * stride, w, o + r * h, h, (float)eps); continue; }
#endif
        rms_row_scalar(x + r * stride, w, o + r * h, h, (float)eps);
    }
    Py_END_ALLOW_THREADS
    (void)vec, (void)vec8;
    Py_RETURN_NONE;
}

static PyObject *silu_mul(PyObject *self, PyObject *args) {
    unsigned long long x_addr, o_addr;
    Py_ssize_t stride, rows, n;
    int dtype, threads, isa_cap;
    if (!PyArg_ParseTuple(args, "KnnnKiii", &x_addr, &stride, &rows, &n, &o_addr, &dtype,
                          &threads, &isa_cap))
        return NULL;
    if (rows < 0 || n < 1 || stride < 2 * n || (dtype != F32 && dtype != BF16)) {
        PyErr_Format(PyExc_ValueError, "bad shape or dtype: rows=%zd n=%zd stride=%zd dtype=%d",
                     rows, n, stride, dtype);
        return NULL;
    }
    const int64_t esz = dtype == F32 ? 4 : 2;
    const char *x = (const char *)x_addr;
    char *o = (char *)o_addr;
    const int vec = use_avx512(n, isa_cap), vec8 = !vec && use_avx2(n, isa_cap);
    const int nt = thread_count(threads, rows, (int64_t)rows * n * 3 * esz);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (Py_ssize_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (vec) { silu_row_avx512(x + r * stride * esz, o + r * n * esz, n, dtype); continue; }
        if (vec8) { silu_row_avx2(x + r * stride * esz, o + r * n * esz, n, dtype); continue; }
#endif
        silu_row_scalar(x + r * stride * esz, o + r * n * esz, n, dtype);
    }
    Py_END_ALLOW_THREADS
    (void)vec, (void)vec8;
    Py_RETURN_NONE;
}

static PyObject *add_rms_norm_bf16(PyObject *self, PyObject *args) {
    unsigned long long x_addr, y_addr, w_addr, o_addr;
    Py_ssize_t rows, h;
    double eps;
    int threads, isa_cap;
    if (!PyArg_ParseTuple(args, "KKnnKKdii", &x_addr, &y_addr, &rows, &h, &w_addr, &o_addr,
                          &eps, &threads, &isa_cap))
        return NULL;
    if (rows < 0 || h < 1) {
        PyErr_Format(PyExc_ValueError, "bad shape: rows=%zd h=%zd", rows, h);
        return NULL;
    }
    uint16_t *x = (uint16_t *)x_addr, *o = (uint16_t *)o_addr;
    const uint16_t *y = (const uint16_t *)y_addr, *w = (const uint16_t *)w_addr;
    const int vec = use_avx512(h, isa_cap), vec8 = !vec && use_avx2(h, isa_cap);
    const int nt = thread_count(threads, rows, (int64_t)rows * h * 6);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (Py_ssize_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (vec) { add_rms_row_avx512(x + r * h, y + r * h, w, o + r * h, h, (float)eps); continue; }
        if (vec8) { add_rms_row_avx2(x + r * h, y + r * h, w, o + r * h, h, (float)eps); continue; }
#endif
        add_rms_row_scalar(x + r * h, y + r * h, w, o + r * h, h, (float)eps);
    }
    Py_END_ALLOW_THREADS
    (void)vec, (void)vec8;
    Py_RETURN_NONE;
}

static PyObject *rope(PyObject *self, PyObject *args) {
    unsigned long long x_addr, c_addr, s_addr;
    Py_ssize_t stride, rows, heads, d;
    int dtype, threads, isa_cap;
    if (!PyArg_ParseTuple(args, "KnnnnKKiii", &x_addr, &stride, &rows, &heads, &d, &c_addr,
                          &s_addr, &dtype, &threads, &isa_cap))
        return NULL;
    if (rows < 0 || heads < 1 || d < 2 || d % 2 || stride < heads * d ||
        (dtype != F32 && dtype != BF16)) {
        PyErr_Format(PyExc_ValueError, "bad shape or dtype: rows=%zd heads=%zd d=%zd "
                     "stride=%zd dtype=%d", rows, heads, d, stride, dtype);
        return NULL;
    }
    const int64_t esz = dtype == F32 ? 4 : 2;
    char *x = (char *)x_addr;
    const char *c = (const char *)c_addr, *s = (const char *)s_addr;
    const int vec = use_avx512(d / 2, isa_cap);
    const int vec2 = !vec && use_avx2(d / 2, isa_cap);
    const int nt = thread_count(threads, rows, (int64_t)rows * heads * d * esz * 2);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (Py_ssize_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (vec) {
            rope_row_avx512(x + r * stride * esz, c + r * d * esz, s + r * d * esz, heads, d, dtype);
            continue;
        }
        if (vec2) {
            rope_row_avx2(x + r * stride * esz, c + r * d * esz, s + r * d * esz, heads, d, dtype);
            continue;
        }
#endif
        rope_row_scalar(x + r * stride * esz, c + r * d * esz, s + r * d * esz, heads, d, dtype);
    }
    Py_END_ALLOW_THREADS
    (void)vec; (void)vec2;
    Py_RETURN_NONE;
}

#include "../../parallel/csrc/shm_allreduce.h"
#include "argmax_rows.h"
#include "rms_f32_rows.h"
#include "f32_gemv.h"

/* The kernels' own AVX2 + FMA + F16C test (runner/cpu/isa.py cpu_has_avx2): the same
 * __builtin_cpu_supports answer the bodies get, an emulated CPU's included. */
static PyObject *has_avx2(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(use_avx2(8, 1));
}

static PyMethodDef methods[] = {
    {"shm_all_reduce", shm_all_reduce, METH_VARARGS, "One rank's step of the shared-memory all-reduce."},
    {"rms_norm_bf16", rms_norm_bf16, METH_VARARGS, "HF-exact bf16 RMSNorm over rows."},
    {"silu_mul", silu_mul, METH_VARARGS, "silu(gate) * up over the rows of a [gate | up] tensor."},
    {"add_rms_norm_bf16", add_rms_norm_bf16, METH_VARARGS, "x += y (bf16), then HF's RMSNorm of x."},
    {"rope", rope, METH_VARARGS, "Rotary embedding of the first heads of each row, in place."},
    {"argmax_rows", argmax_rows, METH_VARARGS, "First index of each fp32 row's maximum (NaN first)."},
    {"rms_norm_f32", rms_norm_f32, METH_VARARGS, "fp32 RMSNorm over rows."},
    {"add_rms_norm_f32", add_rms_norm_f32, METH_VARARGS, "x += y (fp32), then RMSNorm of x."},
    {"has_avx2", has_avx2, METH_NOARGS, "Whether the vector bodies' AVX2 + FMA + F16C test passes."},
    {"gemv_f32", gemv_f32, METH_VARARGS, "fp32 linear of up to 16 rows over panel-packed weights."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_ops",
                                    "Fused element-wise CPU ops.", -1, methods};

PyMODINIT_FUNC PyInit__cpu_ops(void) { return PyModule_Create(&module); }
