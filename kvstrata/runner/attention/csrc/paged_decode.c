/* Decode attention straight over the paged KV pool, without gathering it first
 * (kvstrata/runner/attention/paged_decode.py wraps it; see that file for the why).
 *
 *   decode(q, q_nbytes, q_stride, qo_dtype, k, v, pool_nbytes, kv_dtype, slots, n_slots,
 *          starts, n, hq, hkv, d, scale, out, out_nbytes, num_threads, isa_cap[, ends
 *          [, sinks, n_sinks, softcap]])
 *       -> name of the instruction set used
 *
 * Request b (0 <= b < n) has one query token q[b] of hq heads x d values (fp32 or bf16:
 * qo_dtype 0 / 1; token b's row starts q_stride elements after token b - 1's, so q may be
 * a view of the fused qkv projection) and attends to
 * the keys at slots[starts[b] .. starts[b+1]) of the pool (with `ends`, an address of n
 * int64s: slots[starts[b] .. ends[b]), ranges that may overlap -- the queries of one prompt
 * share its slot list, each up to its own position), whose row `slot` holds hkv heads x
 * d values of `kv_dtype` (0 fp32, 1 bf16, 2 fp16: the layout of one layer of the device pool,
 * [slots, hkv, d]). Query head i reads KV head i / (hq / hkv) (GQA, as HF). The output
 * [n, hq, d] has q's dtype: a bf16 query is widened in L1 and the fp32 result rounded once
 * (to nearest even, as torch's .to(bfloat16)), which saves a bf16 model two conversions
 * (two torch ops, each a pass over q or out) per layer. Every address is an integer; every slot and size is checked against its buffer
 * before anything is read, so a bad index raises IndexError.
 * Softmax extras (paged_decode_isa.h): `sinks` (0, or hq fp32 logits: gpt-oss's per-head sink)
 * and softcap > 0 (Gemma 2's s = softcap * tanh(s / softcap)); per query row, as the rest.
 *
 * A work item is a request (or, when there are few requests for the threads, one KV head of
 * a request): each of its K rows is read once from RAM, converted to fp32 in L1 and scored
 * by every query head that shares it (a gather + SDPA reads each row three times: gather,
 * write the copy, SDPA reads the copy). Three passes per item: scores, softmax (max, exp,
 * sum), weighted sum of values. The vector code is chosen at run time (paged_decode_isa.h).
 *
 * Threads: OpenMP, when built with it. The extension links libgomp.so.1, which resolves to
 * the copy torch already loaded (same soname): our parallel region runs on torch's own
 * OpenMP team, so it neither fights torch's spinning workers for the cores (our pthreads
 * did: measured 3x slower) nor leaves a core idle. The GIL is released meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "paged_decode_isa.h"

#define MAX_THREADS 256
#define MAX_HEADS 256 /* query heads */
/* Below this many K+V bytes a call runs on one thread, as torch keeps small ops serial: a
 * fork/join per layer costs microseconds on an idle box, and far more when other processes
 * hold the cores (a team thread that is not scheduled stalls the whole region). */
#define PARALLEL_MIN_BYTES (1 << 20)
/* Rows are scattered (one slot per token): prefetch the row this many tokens ahead. Far
 * enough that a core keeps many misses in flight: at batch 32, 190 tokens of context, bf16,
 * pages shuffled as in a used pool, 30 layers on 2 threads took 10.5 ms at 4 tokens ahead,
 * 6.6 at 16, 6.2-6.3 at 24-32 and 6.9-7.4 at 64 (AVX-512 EPYC, 2026-12-03). */
#define PREFETCH_TOKENS 32

#include "paged_decode_head64.h"
#include "paged_decode_head64_bf16.h"
#include "paged_decode_head64_avx2.h"
#include "prefill_attention.h"
#include "prefill_call.h"
#include "decode_fixed.h"

static inline void prefetch_bytes(const char *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(p + i, 0, 3);
}

typedef struct {
    const char *q;
    const char *k, *v;
    const int64_t *slots, *starts, *ends; /* ends: NULL (ranges end at the next start) */
    char *out;
    int64_t n, hq, hkv, d, max_len, esz, heads_per_item, items_per_req, q_stride;
    int qo_bf16; /* q and out are bf16 (else fp32) */
    float scale, softcap; /* softcap: 0 = none */
    const float *sinks;   /* hq sink logits, or NULL */
    kernels kn;
    head64_fn head64; /* AVX-512 or AVX2 fast path for 64-wide heads, or NULL */
} job;

/* The attention of one work item over its len > 0 keys, fp32 q in, fp32 o out. */
static void attend(const job *j, const kernels kn, const int64_t *sl, int64_t len, int64_t off,
                   int64_t row_bytes, int64_t width, int64_t h0, int64_t h1, int64_t g_n,
                   int64_t nh, const float *q, float *o, float *scores, float *acc, float *row,
                   int f32) {
    const int64_t d = j->d, esz = j->esz;
    if (j->head64) { /* one KV head at a time, its query heads in registers */
        for (int64_t h = h0; h < h1; h++)
            j->head64(q + (h - h0) * g_n * d, j->k + off + (h - h0) * d * esz,
                      j->v + off + (h - h0) * d * esz, row_bytes, sl, len, j->scale,
                      scores + (h - h0) * g_n * len, o + (h - h0) * g_n * d, kn.softmax,
                      j->softcap, j->sinks ? j->sinks + h * g_n : NULL);
        return;
    }
    for (int64_t t = 0; t < len; t++) {
        if (t + PREFETCH_TOKENS < len)
            prefetch_bytes(j->k + sl[t + PREFETCH_TOKENS] * row_bytes + off, width * esz);
        const char *src = j->k + sl[t] * row_bytes + off;
        const float *kr = f32 ? (const float *)src : row;
        if (!f32) kn.load(row, src, width);
        for (int64_t i = 0; i < nh; i++)
            scores[i * len + t] = kn.dot(q + i * d, kr + (i / g_n) * d, d) * j->scale;
    }
    float inv[MAX_HEADS]; /* hq <= MAX_HEADS, checked at entry */
    const float *sinks = j->sinks ? j->sinks + h0 * g_n : NULL; /* this item's heads' */
    for (int64_t i = 0; i < nh; i++)
        inv[i] = 1.f / kn.softmax(scores + i * len, len, j->softcap, sinks ? sinks + i : NULL);
    memset(acc, 0, (size_t)(nh * d) * sizeof(float));
    for (int64_t t = 0; t < len; t++) {
        if (t + PREFETCH_TOKENS < len)
            prefetch_bytes(j->v + sl[t + PREFETCH_TOKENS] * row_bytes + off, width * esz);
        const char *src = j->v + sl[t] * row_bytes + off;
        const float *vr = f32 ? (const float *)src : row;
        if (!f32) kn.load(row, src, width);
        for (int64_t i = 0; i < nh; i++) kn.axpy(acc + i * d, scores[i * len + t], vr + (i / g_n) * d, d);
    }
    for (int64_t i = 0; i < nh; i++)
        for (int64_t e = 0; e < d; e++) o[i * d + e] = acc[i * d + e] * inv[i];
}

/* Query heads of KV heads [h0, h1) of request b. scores: [(h1 - h0) * g, len]; acc: the same
 * heads x d; row: (h1 - h0) * d floats (one converted K or V row); qo: 2 x heads x d floats
 * (a bf16 query widened, and the result before it is rounded to bf16). */
static void run_item(const job *j, int64_t b, int64_t h0, int64_t h1, float *scores,
                     float *acc, float *row, float *qo) {
    const int64_t g_n = j->hq / j->hkv, d = j->d, esz = j->esz;
    const int64_t row_bytes = j->hkv * d * esz, off = h0 * d * esz, width = (h1 - h0) * d;
    const int64_t qh0 = h0 * g_n, nh = (h1 - h0) * g_n;
    const int64_t *sl = j->slots + j->starts[b];
    const int64_t len = (j->ends ? j->ends[b] : j->starts[b + 1]) - j->starts[b];
    const int64_t q_off = b * j->q_stride + qh0 * d, o_off = (b * j->hq + qh0) * d;
    const float *q = (const float *)j->q + q_off;
    float *o = (float *)j->out + o_off;
    if (j->qo_bf16) {
        const uint16_t *qb = (const uint16_t *)j->q + q_off;
        for (int64_t i = 0; i < nh * d; i++) qo[i] = bf16_to_f32(qb[i]);
        q = qo;
        o = qo + nh * d;
    }
    const kernels kn = j->kn;
    const int f32 = esz == 4;
    if (len == 0) memset(o, 0, (size_t)(nh * d) * sizeof(float));
    else attend(j, kn, sl, len, off, row_bytes, width, h0, h1, g_n, nh, q, o, scores, acc, row, f32);
    if (j->qo_bf16) {
        uint16_t *ob = (uint16_t *)j->out + o_off;
        for (int64_t i = 0; i < nh * d; i++) ob[i] = f32_to_bf16(o[i]);
    }
}

typedef struct { float *scores, *acc, *row, *qo; } scratch;

static int scratch_alloc(scratch *s, const job *j) { /* 0, or -1 when out of memory */
    const int64_t nh = j->heads_per_item * (j->hq / j->hkv);
    s->scores = malloc((size_t)(nh * (j->max_len > 0 ? j->max_len : 1)) * sizeof(float));
    s->acc = malloc((size_t)(nh * j->d) * sizeof(float));
    s->row = malloc((size_t)(j->heads_per_item * j->d) * sizeof(float));
    s->qo = malloc((size_t)(2 * nh * j->d) * sizeof(float));
    return s->scores && s->acc && s->row && s->qo ? 0 : -1;
}
static void scratch_free(scratch *s) { free(s->scores); free(s->acc); free(s->row); free(s->qo); }

static void run_one(const job *j, int64_t it, scratch *s) {
    const int64_t b = it / j->items_per_req, h0 = (it % j->items_per_req) * j->heads_per_item;
    run_item(j, b, h0, h0 + j->heads_per_item, s->scores, s->acc, s->row, s->qo);
}

static PyObject *decode(PyObject *self, PyObject *args) {
    unsigned long long q_addr, k_addr, v_addr, slots_addr, starts_addr, out_addr, ends_addr = 0;
    unsigned long long sinks_addr = 0;
    long long q_nbytes, pool_nbytes, out_nbytes;
    Py_ssize_t q_stride, n_slots, n, hq, hkv, d, n_sinks = 0;
    double scale, softcap = 0.0;
    int qo_dtype, kv_dtype, num_threads, isa_cap, fixed = 0;
    if (!PyArg_ParseTuple(args, "KLniKKLiKnKnnnndKLii|KKndi", &q_addr, &q_nbytes, &q_stride,
                          &qo_dtype, &k_addr, &v_addr, &pool_nbytes, &kv_dtype, &slots_addr,
                          &n_slots, &starts_addr, &n, &hq, &hkv, &d, &scale, &out_addr,
                          &out_nbytes, &num_threads, &isa_cap, &ends_addr, &sinks_addr,
                          &n_sinks, &softcap, &fixed))
        return NULL;
    if (fixed && (sinks_addr || softcap != 0.0 || qo_dtype != kv_dtype || kv_dtype == KV_F16 ||
                  d > PF_MAX_D)) {
        PyErr_Format(PyExc_ValueError, "fixed (the prefill kernel's order) takes q and a pool "
                     "of one dtype, fp32 or bf16, head_dim <= %d and no sinks or softcap",
                     PF_MAX_D);
        return NULL;
    }
    if ((sinks_addr && n_sinks != hq) || !(softcap >= 0.0)) {
        PyErr_Format(PyExc_ValueError, "sinks must hold one logit per query head (%zd, got "
                     "%zd) and softcap must be >= 0 (0: none)", hq, n_sinks);
        return NULL;
    }
    if (n < 0 || hq < 1 || hkv < 1 || d < 1 || hq % hkv || hq > MAX_HEADS) {
        PyErr_Format(PyExc_ValueError, "bad shape: n=%zd hq=%zd hkv=%zd d=%zd (hq must be a "
                     "multiple of hkv, at most %d query heads)", n, hq, hkv, d,
                     MAX_HEADS);
        return NULL;
    }
    if (kv_dtype != KV_F32 && kv_dtype != KV_BF16 && kv_dtype != KV_F16) {
        PyErr_Format(PyExc_ValueError, "kv_dtype %d is not 0 (fp32), 1 (bf16) or 2 (fp16)",
                     kv_dtype);
        return NULL;
    }
    if (qo_dtype != KV_F32 && qo_dtype != KV_BF16) {
        PyErr_Format(PyExc_ValueError, "q dtype %d is not 0 (fp32) or 1 (bf16)", qo_dtype);
        return NULL;
    }
    if (q_stride < hq * d) {
        PyErr_Format(PyExc_ValueError, "q_stride %zd < hq * d = %zd", q_stride, hq * d);
        return NULL;
    }
    const int64_t qo_esz = qo_dtype == KV_F32 ? 4 : 2;
    const int64_t qn = n ? ((int64_t)(n - 1) * q_stride + hq * d) * qo_esz : 0;
    const int64_t on = (int64_t)n * hq * d * qo_esz;
    if (qn > q_nbytes || on > out_nbytes) {
        PyErr_Format(PyExc_IndexError, "q/out hold %lld/%lld bytes, need %lld/%lld", q_nbytes,
                     out_nbytes, (long long)qn, (long long)on);
        return NULL;
    }
    const int64_t esz = kv_dtype == KV_F32 ? 4 : 2;
    const int64_t row_bytes = (int64_t)hkv * d * esz;
    const int64_t pool_rows = pool_nbytes / row_bytes;
    const int64_t *starts = (const int64_t *)starts_addr, *slots = (const int64_t *)slots_addr;
    const int64_t *ends = (const int64_t *)ends_addr;
    int64_t max_len = 0, keys_read = n_slots; /* K rows the call reads (ranges: their sum) */
    if (ends) {
        keys_read = 0; /* ranges [starts[b], ends[b]) inside the slots */
        for (Py_ssize_t b = 0; b < n; b++) {
            if (starts[b] < 0 || ends[b] < starts[b] || ends[b] > n_slots) {
                PyErr_Format(PyExc_IndexError, "range %zd [%lld, %lld) is not inside the %zd "
                             "slots", b, (long long)starts[b], (long long)ends[b], n_slots);
                return NULL;
            }
            if (ends[b] - starts[b] > max_len) max_len = ends[b] - starts[b];
            keys_read += ends[b] - starts[b];
        }
    } else {
        if (starts[0] != 0 || starts[n] != n_slots) {
            PyErr_Format(PyExc_IndexError, "starts must run from 0 to n_slots=%zd", n_slots);
            return NULL;
        }
        for (Py_ssize_t b = 0; b < n; b++) {
            int64_t len = starts[b + 1] - starts[b];
            if (len < 0) { PyErr_SetString(PyExc_IndexError, "starts must not decrease"); return NULL; }
            if (len > max_len) max_len = len;
        }
    }
    for (Py_ssize_t i = 0; i < n_slots; i++)
        if (slots[i] < 0 || slots[i] >= pool_rows) {
            PyErr_Format(PyExc_IndexError, "slot %lld outside the pool (%lld rows)",
                         (long long)slots[i], (long long)pool_rows);
            return NULL;
        }
    int threads = num_threads < 1 ? 1 : (num_threads > MAX_THREADS ? MAX_THREADS : num_threads);
#ifndef _OPENMP
    threads = 1;
#endif
    if (keys_read * row_bytes * 2 < PARALLEL_MIN_BYTES) threads = 1;
    if (fixed) { /* deterministic inference: the prefill kernel's order (decode_fixed.h) */
        int used = 0;
        if (decode_fixed((const char *)q_addr, q_stride, (const char *)k_addr,
                         (const char *)v_addr, slots, starts, ends, n, hq, hkv, d,
                         kv_dtype == KV_BF16, (float)scale, (char *)out_addr, threads,
                         isa_cap, &used))
            return PyErr_NoMemory();
        return PyUnicode_FromString(ISA_NAMES[used]);
    }
    /* Few requests for the threads: one item per (request, KV head) so every thread works. */
    const int64_t split = n < 2 * (int64_t)threads ? hkv : 1;
    job j = {(const char *)q_addr, (const char *)k_addr, (const char *)v_addr, slots, starts,
             ends, (char *)out_addr, n, hq, hkv, d, max_len, esz, hkv / split, split, q_stride,
             qo_dtype == KV_BF16, (float)scale, (float)softcap, (const float *)sinks_addr,
             pick_kernels(d, kv_dtype, isa_cap), NULL};
    j.head64 = pick_head64(&j.kn, d, hq / hkv, kv_dtype); /* AVX-512, or NULL */
    if (j.head64)
        j.head64 = pick_head64_bf16(j.head64, hq / hkv, qo_dtype == KV_BF16, kv_dtype);
    j.head64 = pick_head64_avx2(j.head64, &j.kn, d, hq / hkv, kv_dtype);
    const int64_t items = (int64_t)n * split;
    if (threads > items) threads = items > 0 ? (int)items : 1;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        scratch s;
        int bad = scratch_alloc(&s, &j);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++)
            if (!bad) run_one(&j, it, &s);
        scratch_free(&s);
        failed |= bad != 0;
    }
#else
    scratch s;
    failed = scratch_alloc(&s, &j) != 0;
    for (int64_t it = 0; !failed && it < items; it++) run_one(&j, it, &s);
    scratch_free(&s);
#endif
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    return PyUnicode_FromString(ISA_NAMES[j.kn.isa]);
}

static PyObject *isa(PyObject *self, PyObject *args) {
    Py_ssize_t d;
    int kv_dtype, isa_cap;
    if (!PyArg_ParseTuple(args, "nii", &d, &kv_dtype, &isa_cap)) return NULL;
    return PyUnicode_FromString(ISA_NAMES[pick_kernels(d, kv_dtype, isa_cap).isa]);
}

static PyObject *openmp(PyObject *self, PyObject *args) {
#ifdef _OPENMP
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "Paged decode attention over a KV pool (see source)."},
    {"prefill", prefill, METH_VARARGS, "Causal prefill attention over a chunk's own keys."},
    {"prefill_isa", prefill_isa, METH_VARARGS,
     "The instruction set prefill uses for (head_dim, cap)."},
    {"isa", isa, METH_VARARGS, "The instruction set decode uses for (head_dim, kv_dtype, cap)."},
    {"openmp", openmp, METH_NOARGS, "Whether the kernel was built with OpenMP threads."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_decode",
                                    "Paged decode attention for the CPU.", -1, methods};

PyMODINIT_FUNC PyInit__paged_decode(void) { return PyModule_Create(&module); }
