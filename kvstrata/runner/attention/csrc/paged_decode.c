/* Decode attention straight over the paged fp32 KV pool, without gathering it first
 * (kvstrata/runner/attention/paged_decode.py wraps it; see that file for the why).
 *
 *   decode(q, q_nbytes, k, v, pool_nbytes, slots, n_slots, starts, n, hq, hkv, d, scale,
 *          out, out_nbytes, num_threads)
 *
 * Request b (0 <= b < n) has one query token q[b] of hq heads x d floats and attends to the
 * keys at slots[starts[b] .. starts[b+1]) of the pool, whose row `slot` holds hkv heads x d
 * floats (the layout of one layer of the device pool: [slots, hkv, d]). Query head i reads KV
 * head i / (hq / hkv) (GQA, as HF). Every address is an integer; every slot and size is checked
 * against its buffer before anything is read, so a bad index raises IndexError.
 *
 * One work item is a request: every query head is scored against each token's whole K row
 * (all KV heads, contiguous), so each key and value row is read once from RAM (a gather +
 * SDPA reads it three times: gather, write the copy, SDPA reads the copy). Three passes per
 * item: scores, softmax (max, exp, sum), weighted sum of values. Requests are split between
 * `num_threads` threads (the caller's and num_threads - 1 pthreads); the GIL is released.
 * AVX2+FMA paths are chosen at run time; the scalar path gives the same math.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_THREADS 64
#define MAX_HEADS 256 /* query heads */
/* Rows are scattered (one slot per token): prefetch the row this many tokens ahead. */
#define PREFETCH_TOKENS 4

static inline void prefetch_row(const float *row, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(row + i, 0, 3);
}

typedef struct {
    const float *q, *k, *v;
    const int64_t *slots, *starts;
    float *out;
    int64_t n, hq, hkv, d, max_len;
    float scale;
    int avx2;
} job;

typedef struct {
    const job *j;
    int64_t lo, hi; /* requests [lo, hi) */
    int failed;     /* out of memory */
} part;

/* ---- scalar kernels --------------------------------------------------------------------- */
static float dot_scalar(const float *a, const float *b, int64_t d) {
    float s = 0.f;
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}
static void axpy_scalar(float *acc, float p, const float *x, int64_t d) {
    for (int64_t i = 0; i < d; i++) acc[i] += p * x[i];
}
static float softmax_scalar(float *s, int64_t len) { /* s <- exp(s - max); returns the sum */
    float m = s[0], sum = 0.f;
    for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
    for (int64_t t = 0; t < len; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
    return sum;
}

/* ---- AVX2 + FMA kernels (d % 8 == 0) ---------------------------------------------------- */
#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,fma")))
AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
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
/* exp(x) for x <= 0 (softmax arguments): 2^n * e^r, r = x - n ln2 in [-ln2/2, ln2/2], e^r by
 * its degree-6 Taylor polynomial (truncation error < 2e-7 relative, about 1-2 ulp). Inputs
 * below -87 are clamped: e^-87 is ~1e-38, nothing next to the max term's 1. */
AVX2 static inline __m256 exp_nonpos_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
AVX2 static float softmax_avx2(float *s, int64_t len) {
    float m = s[0];
    for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
    __m256 mv = _mm256_set1_ps(m), sum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        __m256 e = exp_nonpos_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum256(sum);
    for (; t < len; t++) { s[t] = expf(s[t] - m); total += s[t]; }
    return total;
}
#endif

static void run_item(const job *j, int64_t b, float *scores, float *acc) {
    const int64_t hq = j->hq, hkv = j->hkv, g_n = hq / hkv, d = j->d, stride = hkv * d;
    const int64_t *sl = j->slots + j->starts[b];
    const int64_t len = j->starts[b + 1] - j->starts[b];
    const float *q = j->q + b * hq * d;
    float *o = j->out + b * hq * d;
    if (len == 0) { memset(o, 0, (size_t)(hq * d) * sizeof(float)); return; }
    float (*dot)(const float *, const float *, int64_t) = dot_scalar;
    void (*axpy)(float *, float, const float *, int64_t) = axpy_scalar;
    float (*softmax)(float *, int64_t) = softmax_scalar;
#if defined(__x86_64__)
    if (j->avx2) { dot = dot_avx2; axpy = axpy_avx2; softmax = softmax_avx2; }
#endif
    /* Token-major: a token's whole K (then V) row, every KV head, is read once and used by
     * every query head; a head-major loop re-reads the context hkv times with a stride. */
    for (int64_t t = 0; t < len; t++) {
        if (t + PREFETCH_TOKENS < len) prefetch_row(j->k + sl[t + PREFETCH_TOKENS] * stride, stride);
        const float *kr = j->k + sl[t] * stride;
        for (int64_t i = 0; i < hq; i++) scores[i * len + t] = dot(q + i * d, kr + (i / g_n) * d, d) * j->scale;
    }
    float inv[MAX_HEADS]; /* hq <= MAX_HEADS, checked at entry */
    for (int64_t i = 0; i < hq; i++) inv[i] = 1.f / softmax(scores + i * len, len);
    memset(acc, 0, (size_t)(hq * d) * sizeof(float));
    for (int64_t t = 0; t < len; t++) {
        if (t + PREFETCH_TOKENS < len) prefetch_row(j->v + sl[t + PREFETCH_TOKENS] * stride, stride);
        const float *vr = j->v + sl[t] * stride;
        for (int64_t i = 0; i < hq; i++) axpy(acc + i * d, scores[i * len + t], vr + (i / g_n) * d, d);
    }
    for (int64_t i = 0; i < hq; i++)
        for (int64_t e = 0; e < d; e++) o[i * d + e] = acc[i * d + e] * inv[i];
}

static void *run_part(void *arg) {
    part *p = (part *)arg;
    const job *j = p->j;
    float *scores = malloc((size_t)(j->hq * (j->max_len > 0 ? j->max_len : 1)) * sizeof(float));
    float *acc = malloc((size_t)(j->hq * j->d) * sizeof(float));
    if (!scores || !acc) { p->failed = 1; free(scores); free(acc); return NULL; }
    for (int64_t it = p->lo; it < p->hi; it++) run_item(j, it, scores, acc);
    free(scores); free(acc);
    return NULL;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    unsigned long long q_addr, k_addr, v_addr, slots_addr, starts_addr, out_addr;
    long long q_nbytes, pool_nbytes, out_nbytes;
    Py_ssize_t n_slots, n, hq, hkv, d;
    double scale;
    int num_threads;
    if (!PyArg_ParseTuple(args, "KLKKLKnKnnnndKLi", &q_addr, &q_nbytes, &k_addr, &v_addr,
                          &pool_nbytes, &slots_addr, &n_slots, &starts_addr, &n, &hq, &hkv, &d,
                          &scale, &out_addr, &out_nbytes, &num_threads))
        return NULL;
    if (n < 0 || hq < 1 || hkv < 1 || d < 1 || hq % hkv || hq > MAX_HEADS) {
        PyErr_Format(PyExc_ValueError, "bad shape: n=%zd hq=%zd hkv=%zd d=%zd (hq must be a "
                     "multiple of hkv, at most %d query heads)", n, hq, hkv, d,
                     MAX_HEADS);
        return NULL;
    }
    const int64_t qn = (int64_t)n * hq * d * (int64_t)sizeof(float);
    if (qn > q_nbytes || qn > out_nbytes) {
        PyErr_Format(PyExc_IndexError, "q/out hold %lld/%lld bytes, need %lld", q_nbytes,
                     out_nbytes, (long long)qn);
        return NULL;
    }
    const int64_t row_bytes = (int64_t)hkv * d * (int64_t)sizeof(float);
    const int64_t pool_rows = pool_nbytes / row_bytes;
    const int64_t *starts = (const int64_t *)starts_addr, *slots = (const int64_t *)slots_addr;
    int64_t max_len = 0;
    if (starts[0] != 0 || starts[n] != n_slots) {
        PyErr_Format(PyExc_IndexError, "starts must run from 0 to n_slots=%zd", n_slots);
        return NULL;
    }
    for (Py_ssize_t b = 0; b < n; b++) {
        int64_t len = starts[b + 1] - starts[b];
        if (len < 0) { PyErr_SetString(PyExc_IndexError, "starts must not decrease"); return NULL; }
        if (len > max_len) max_len = len;
    }
    for (Py_ssize_t i = 0; i < n_slots; i++)
        if (slots[i] < 0 || slots[i] >= pool_rows) {
            PyErr_Format(PyExc_IndexError, "slot %lld outside the pool (%lld rows)",
                         (long long)slots[i], (long long)pool_rows);
            return NULL;
        }
    job j = {(const float *)q_addr, (const float *)k_addr, (const float *)v_addr, slots, starts,
             (float *)out_addr, n, hq, hkv, d, max_len, (float)scale, 0};
#if defined(__x86_64__)
    j.avx2 = d % 8 == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    const int64_t items = (int64_t)n;
    int threads = num_threads < 1 ? 1 : (num_threads > MAX_THREADS ? MAX_THREADS : num_threads);
    if (threads > items) threads = items > 0 ? (int)items : 1;
    part parts[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0}, failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++)
        parts[t] = (part){&j, items * t / threads, items * (t + 1) / threads, 0};
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tids[t], NULL, run_part, &parts[t]) == 0;
    run_part(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
        else run_part(&parts[t]); /* no thread: do its share here */
    }
    for (int t = 0; t < threads; t++) failed |= parts[t].failed;
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "Paged decode attention over an fp32 KV pool (see source)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_decode",
                                    "Paged decode attention for the CPU.", -1, methods};

PyMODINIT_FUNC PyInit__paged_decode(void) { return PyModule_Create(&module); }
