/* Fused element-wise ops of the llama-family decoder on the CPU (kvstrata/runner/cpu_ops.py
 * wraps them; see there for when they run and what they replace).
 *
 *   rms_norm_bf16(x, x_row_stride, rows, h, w, out, eps, threads, isa_cap)
 *       out[r] = bf16(w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)))   (HF's two roundings)
 *   silu_mul(x, x_row_stride, rows, inter, out, dtype, threads, isa_cap)
 *       out[r] = silu(x[r, :inter]) * x[r, inter:2*inter]; bf16: bf16(bf16(silu(g)) * u)
 *   shm_all_reduce(...)   one rank's step of the shared-memory all-reduce (see below)
 *
 * x rows may be strided (a view), their elements contiguous; out is contiguous. Every
 * intermediate is fp32, rounded to bf16 where torch's unfused ops round (round to nearest
 * even), so the result equals the op sequence it replaces up to fp32 summation order and the
 * exp approximation (< 2e-7 relative). Vector code (AVX-512F) is chosen at run time; the
 * scalar path computes the same. Rows are split across OpenMP threads (torch's own team, as
 * in attention/csrc/paged_decode.c) above a size where the fork pays.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include "cpu_vec.h"

#define PARALLEL_MIN_BYTES (256 << 10)
enum { F32 = 0, BF16 = 1 };

static inline float silu_f(float g) { return g / (1.f + expf(-g)); }

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
AVX512 static inline __m512 silu_v(__m512 g) { /* g * sigmoid(g), exp of -|g| only */
    __m512 e = exp_nonpos_avx512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), e);
    __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, _mm512_set1_ps(1.f), e), den);
    return _mm512_mul_ps(g, sig);
}
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

static int use_avx512(int64_t width, int isa_cap) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return isa_cap >= 2 && width % 16 == 0 && __builtin_cpu_supports("avx512f");
#else
    (void)width; (void)isa_cap;
    return 0;
#endif
}

static int thread_count(int threads, int64_t rows, int64_t bytes) {
#ifdef _OPENMP
    if (bytes < PARALLEL_MIN_BYTES || threads < 1) return 1;
    return rows < threads ? (int)(rows > 0 ? rows : 1) : threads;
#else
    (void)threads; (void)rows; (void)bytes;
    return 1;
#endif
}

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
    const int vec = use_avx512(h, isa_cap);
    const int nt = thread_count(threads, rows, (int64_t)rows * h * 2);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (Py_ssize_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (vec) { rms_row_avx512(x + r * stride, w, o + r * h, h, (float)eps); continue; }
#endif
        rms_row_scalar(x + r * stride, w, o + r * h, h, (float)eps);
    }
    Py_END_ALLOW_THREADS
    (void)vec;
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
    const int vec = use_avx512(n, isa_cap);
    const int nt = thread_count(threads, rows, (int64_t)rows * n * 3 * esz);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (Py_ssize_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (vec) { silu_row_avx512(x + r * stride * esz, o + r * n * esz, n, dtype); continue; }
#endif
        silu_row_scalar(x + r * stride * esz, o + r * n * esz, n, dtype);
    }
    Py_END_ALLOW_THREADS
    (void)vec;
    Py_RETURN_NONE;
}

/* ---- shared-memory all-reduce (kvstrata/runner/parallel/shm_allreduce.py) ---------------
 *   shm_all_reduce(base, header, slot_bytes, rank, size, seq, t, numel, dtype, published,
 *                  max_spins) -> 1 done | 0 still waiting
 * The layout and protocol are the module's: a flag per rank every 64 bytes from `base`, then
 * two buffers of `size` slots. Unless `published`, copies t into this rank's slot of buffer
 * seq % 2 and stores the flag (release); then spins (pause, then sched_yield) up to
 * `max_spins` times until every flag reached seq (acquire loads) and, when they have, sums
 * the slots in rank order in fp32 into t (bf16: rounded once at the end, as torch's
 * fp32 accumulator copied back) -- the same bits on every rank. Returning 0 lets the caller
 * check its abort reason and timeout, then call again with published=1. */
#if defined(__x86_64__)
AVX512 static void sum_slots_avx512(char *const *src, int64_t size, void *t, int64_t numel,
                                    int dtype) {
    for (int64_t i = 0; i < numel; i += 16) {
        __m512 acc = dtype == F32 ? _mm512_loadu_ps((const float *)src[0] + i)
                                  : bf16x16_load((const uint16_t *)src[0] + i);
        for (int64_t r = 1; r < size; r++)
            acc = _mm512_add_ps(acc, dtype == F32 ? _mm512_loadu_ps((const float *)src[r] + i)
                                                  : bf16x16_load((const uint16_t *)src[r] + i));
        if (dtype == F32) _mm512_storeu_ps((float *)t + i, acc);
        else _mm256_storeu_si256((__m256i *)((uint16_t *)t + i), bf16x16_from(acc));
    }
}
#endif
static void sum_slots(char *const *src, int64_t size, void *t, int64_t numel, int dtype,
                      int isa_cap) {
    int64_t head = 0;
#if defined(__x86_64__)
    if (use_avx512(16, isa_cap)) {
        head = numel - numel % 16;
        sum_slots_avx512(src, size, t, head, dtype);
    }
#else
    (void)isa_cap;
#endif
    for (int64_t i = head; i < numel; i++) {
        float acc = dtype == F32 ? ((const float *)src[0])[i]
                                 : bf16_to_f32(((const uint16_t *)src[0])[i]);
        for (int64_t r = 1; r < size; r++)
            acc += dtype == F32 ? ((const float *)src[r])[i]
                                : bf16_to_f32(((const uint16_t *)src[r])[i]);
        if (dtype == F32) ((float *)t)[i] = acc;
        else ((uint16_t *)t)[i] = f32_to_bf16(acc);
    }
}

#define SHM_MAX_RANKS 64
#define SHM_SPINS_BEFORE_YIELD 200
static PyObject *shm_all_reduce(PyObject *self, PyObject *args) {
    unsigned long long base_addr, t_addr;
    Py_ssize_t header, slot_bytes, rank, size, numel;
    long long seq;
    int dtype, published, max_spins, isa_cap;
    if (!PyArg_ParseTuple(args, "KnnnnLKniiii", &base_addr, &header, &slot_bytes, &rank, &size,
                          &seq, &t_addr, &numel, &dtype, &published, &max_spins, &isa_cap))
        return NULL;
    const int64_t esz = dtype == F32 ? 4 : 2;
    if ((dtype != F32 && dtype != BF16) || size < 1 || size > SHM_MAX_RANKS || rank < 0 ||
        rank >= size || numel < 0 || numel * esz > slot_bytes || header < 64 * size) {
        PyErr_Format(PyExc_ValueError, "shm_all_reduce: bad arguments (rank %zd of %zd, %zd "
                     "elements of dtype %d, slot %zd bytes)", rank, size, numel, dtype,
                     slot_bytes);
        return NULL;
    }
    char *base = (char *)base_addr;
    char *src[SHM_MAX_RANKS];
    for (int64_t r = 0; r < size; r++)
        src[r] = base + header + ((seq % 2) * size + r) * slot_bytes;
    int done = 0;
    Py_BEGIN_ALLOW_THREADS
    if (!published) {
        memcpy(src[rank], (const void *)t_addr, (size_t)(numel * esz));
        __atomic_store_n((int64_t *)(base + 64 * rank), (int64_t)seq, __ATOMIC_RELEASE);
    }
    for (int spin = 0; spin < max_spins && !done; spin++) {
        done = 1;
        for (int64_t r = 0; r < size && done; r++)
            done = __atomic_load_n((int64_t *)(base + 64 * r), __ATOMIC_ACQUIRE) >= seq;
        if (!done) {
            if (spin >= SHM_SPINS_BEFORE_YIELD) sched_yield();
#if defined(__x86_64__)
            else __builtin_ia32_pause();
#endif
        }
    }
    if (done) sum_slots(src, size, (void *)t_addr, numel, dtype, isa_cap);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(done);
}

static PyMethodDef methods[] = {
    {"shm_all_reduce", shm_all_reduce, METH_VARARGS, "One rank's step of the shared-memory all-reduce."},
    {"rms_norm_bf16", rms_norm_bf16, METH_VARARGS, "HF-exact bf16 RMSNorm over rows."},
    {"silu_mul", silu_mul, METH_VARARGS, "silu(gate) * up over the rows of a [gate | up] tensor."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_ops",
                                    "Fused element-wise CPU ops.", -1, methods};

PyMODINIT_FUNC PyInit__cpu_ops(void) { return PyModule_Create(&module); }
