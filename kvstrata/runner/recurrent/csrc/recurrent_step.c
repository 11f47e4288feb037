/* The recurrent layers' decode step on the CPU, in place on the state pool (kvstrata/runner/
 * recurrent/fused_step.py wraps it; runner/recurrent/gated_delta.py and ssd.py hold the torch
 * arithmetic it replaces):
 *
 *   gated_delta_step(state, slots, n, q, k, v, g, beta, out, hv, dk, dv, dtype, threads, isa)
 *       per row r and value head h, S = state[slots[r], h] (dk x dv, fp32 or bf16):
 *         kv = S^T k;  delta = (v - exp(g) kv) * beta;  S = exp(g) S + k delta^T;  o = S^T q
 *       one read pass and one read-write pass over S (torch: gather, five full-size ops,
 *       scatter). q, k, v, g, beta, out fp32 contiguous [n, hv, ...] (q, k normalised,
 *       scaled and repeated to the value heads by the caller).
 *   ssd_step(state, slots, n, x, dt, a, b, c, d, out, heads, p, n_state, groups, dtype,
 *            threads, isa)
 *       per row r and head h, S = state[slots[r], h] (p x n_state):
 *         S = exp(dt a) S + dt x B^T;  y = S C + d x        (B, C of the head's group)
 *       one read-write pass. x, out fp32 [n, heads, p]; dt [n, heads] (discretized); a, d
 *       [heads]; b, c [n, groups, n_state].
 *
 * The state is read and rounded back in its own dtype (bf16: round to nearest even), every
 * sum in fp32. One C body, compiled for AVX-512F, AVX2 + FMA and plain x86-64 (the loops over
 * a row of the state are vectorised by the compiler for each) and chosen at run time under
 * KVSTRATA_CPU_ISA's cap (isa 2 / 1 / 0) like the other CPU kernels; (row, head) pairs are
 * split across OpenMP threads (torch's team) above a size where the fork pays.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../../cpu/csrc/cpu_rows.h"

enum { F32 = 0, BF16 = 1 };
#define MAX_DV 4096 /* per-(row, head) scratch on the stack */

static inline float ld_f32(const float *p) { return *p; }
static inline void st_f32(float *p, float v) { *p = v; }
static inline float ld_bf16(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline void st_bf16(uint16_t *p, float f) { /* round to nearest even (finite) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    *p = (uint16_t)(u >> 16);
}

#define GDN_HEAD(NAME, ATTR, T, LD, ST)                                                        \
    ATTR static void NAME(T *s, const float *q, const float *k, const float *v, float g,      \
                          float beta, float *o, int64_t dk, int64_t dv) {                      \
        float kv[MAX_DV], delta[MAX_DV];                                                        \
        const float decay = expf(g);                                                            \
        for (int64_t j = 0; j < dv; j++) kv[j] = 0.f;                                           \
        for (int64_t i = 0; i < dk; i++) {                                                      \
            const T *row = s + i * dv;                                                          \
            const float ki = k[i];                                                              \
            for (int64_t j = 0; j < dv; j++) kv[j] += LD(row + j) * ki;                         \
        }                                                                                       \
        for (int64_t j = 0; j < dv; j++) {                                                      \
            delta[j] = (v[j] - decay * kv[j]) * beta;                                           \
            o[j] = 0.f;                                                                         \
        }                                                                                       \
        for (int64_t i = 0; i < dk; i++) {                                                      \
            T *row = s + i * dv;                                                                \
            const float ki = k[i], qi = q[i];                                                   \
            for (int64_t j = 0; j < dv; j++) {                                                  \
                const float x = LD(row + j) * decay + ki * delta[j];                            \
                ST(row + j, x);                                                                 \
                o[j] += x * qi; /* the unrounded state, as torch's step reads it */            \
            }                                                                                   \
        }                                                                                       \
    }

#define SSD_HEAD(NAME, ATTR, T, LD, ST)                                                        \
    ATTR static void NAME(T *s, const float *x, float dt, float a, const float *b,            \
                          const float *c, float d, float *y, int64_t p, int64_t n) {          \
        const float da = expf(dt * a);                                                          \
        for (int64_t i = 0; i < p; i++) {                                                       \
            T *row = s + i * n;                                                                 \
            const float xdt = x[i] * dt;                                                        \
            float acc = 0.f;                                                                    \
            for (int64_t j = 0; j < n; j++) {                                                   \
                const float v = LD(row + j) * da + xdt * b[j];                                  \
                ST(row + j, v);                                                                 \
                acc += v * c[j];                                                                \
            }                                                                                   \
            y[i] = acc + d * x[i];                                                              \
        }                                                                                       \
    }

#if defined(__x86_64__)
#define TGT_AVX512 __attribute__((target("avx512f,fma")))
#define TGT_AVX2 __attribute__((target("avx2,fma")))
#else
#define TGT_AVX512
#define TGT_AVX2
#endif
#define BODIES(KIND, HEAD)                                                                      \
    HEAD(KIND##_f32_scalar, , float, ld_f32, st_f32)                                            \
    HEAD(KIND##_bf16_scalar, , uint16_t, ld_bf16, st_bf16)                                      \
    HEAD(KIND##_f32_avx2, TGT_AVX2, float, ld_f32, st_f32)                                      \
    HEAD(KIND##_bf16_avx2, TGT_AVX2, uint16_t, ld_bf16, st_bf16)                                \
    HEAD(KIND##_f32_avx512, TGT_AVX512, float, ld_f32, st_f32)                                  \
    HEAD(KIND##_bf16_avx512, TGT_AVX512, uint16_t, ld_bf16, st_bf16)
BODIES(gdn, GDN_HEAD)
BODIES(ssd, SSD_HEAD)

/* 2 = AVX-512F, 1 = AVX2 + FMA, 0 = plain, under the cap (the width only picks the body). */
static int isa_level(int isa_cap) {
    if (use_avx512(16, isa_cap)) return 2;
    if (use_avx2(8, isa_cap)) return 1;
    return 0;
}

static PyObject *gated_delta_step(PyObject *self, PyObject *args) {
    unsigned long long st, sl, qa, ka, va, ga, ba, oa;
    Py_ssize_t n, hv, dk, dv;
    int dtype, threads, isa_cap;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKnKKKKKKnnniii", &st, &sl, &n, &qa, &ka, &va, &ga, &ba, &oa,
                          &hv, &dk, &dv, &dtype, &threads, &isa_cap))
        return NULL;
    if (n < 0 || hv < 1 || dk < 1 || dv < 1 || dv > MAX_DV || (dtype != F32 && dtype != BF16)) {
        PyErr_Format(PyExc_ValueError, "bad gated_delta_step shape: n=%zd hv=%zd dk=%zd dv=%zd",
                     n, hv, dk, dv);
        return NULL;
    }
    const int64_t *slots = (const int64_t *)sl;
    const float *q = (const float *)qa, *k = (const float *)ka, *v = (const float *)va;
    const float *g = (const float *)ga, *beta = (const float *)ba;
    float *o = (float *)oa;
    const int level = isa_level(isa_cap);
    const int64_t pairs = (int64_t)n * hv, head = (int64_t)dk * dv;
    const int nt = thread_count(threads, pairs, pairs * head * (dtype == F32 ? 4 : 2));
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t ph = 0; ph < pairs; ph++) {
        const int64_t r = ph / hv, h = ph % hv, at = (slots[r] * hv + h) * head;
        const float *qh = q + ph * dk, *kh = k + ph * dk, *vh = v + ph * dv;
        float *oh = o + ph * dv;
        if (dtype == F32) {
            float *s = (float *)st + at;
            if (level == 2) gdn_f32_avx512(s, qh, kh, vh, g[ph], beta[ph], oh, dk, dv);
            else if (level == 1) gdn_f32_avx2(s, qh, kh, vh, g[ph], beta[ph], oh, dk, dv);
            else gdn_f32_scalar(s, qh, kh, vh, g[ph], beta[ph], oh, dk, dv);
        } else {
            uint16_t *s = (uint16_t *)st + at;
            if (level == 2) gdn_bf16_avx512(s, qh, kh, vh, g[ph], beta[ph], oh, dk, dv);
            else if (level == 1) gdn_bf16_avx2(s, qh, kh, vh, g[ph], beta[ph], oh, dk, dv);
            else gdn_bf16_scalar(s, qh, kh, vh, g[ph], beta[ph], oh, dk, dv);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *ssd_step(PyObject *self, PyObject *args) {
    unsigned long long st, sl, xa, dta, aa, ba, ca, da, ya;
    Py_ssize_t n, heads, p, ns, groups;
    int dtype, threads, isa_cap;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKnKKKKKKKnnnniii", &st, &sl, &n, &xa, &dta, &aa, &ba, &ca,
                          &da, &ya, &heads, &p, &ns, &groups, &dtype, &threads, &isa_cap))
        return NULL;
    if (n < 0 || heads < 1 || p < 1 || ns < 1 || groups < 1 || heads % groups ||
        (dtype != F32 && dtype != BF16)) {
        PyErr_Format(PyExc_ValueError, "bad ssd_step shape: heads=%zd p=%zd n=%zd groups=%zd",
                     heads, p, ns, groups);
        return NULL;
    }
    const int64_t *slots = (const int64_t *)sl;
    const float *x = (const float *)xa, *dt = (const float *)dta, *a = (const float *)aa;
    const float *b = (const float *)ba, *c = (const float *)ca, *d = (const float *)da;
    float *y = (float *)ya;
    const int level = isa_level(isa_cap);
    const int64_t pairs = (int64_t)n * heads, head = (int64_t)p * ns, per_group = heads / groups;
    const int nt = thread_count(threads, pairs, pairs * head * (dtype == F32 ? 4 : 2));
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t ph = 0; ph < pairs; ph++) {
        const int64_t r = ph / heads, h = ph % heads, at = (slots[r] * heads + h) * head;
        const int64_t gi = (r * groups + h / per_group) * ns;
        const float *xh = x + ph * p;
        float *yh = y + ph * p;
        if (dtype == F32) {
            float *s = (float *)st + at;
            if (level == 2) ssd_f32_avx512(s, xh, dt[ph], a[h], b + gi, c + gi, d[h], yh, p, ns);
            else if (level == 1) ssd_f32_avx2(s, xh, dt[ph], a[h], b + gi, c + gi, d[h], yh, p, ns);
            else ssd_f32_scalar(s, xh, dt[ph], a[h], b + gi, c + gi, d[h], yh, p, ns);
        } else {
            uint16_t *s = (uint16_t *)st + at;
            if (level == 2) ssd_bf16_avx512(s, xh, dt[ph], a[h], b + gi, c + gi, d[h], yh, p, ns);
            else if (level == 1) ssd_bf16_avx2(s, xh, dt[ph], a[h], b + gi, c + gi, d[h], yh, p, ns);
            else ssd_bf16_scalar(s, xh, dt[ph], a[h], b + gi, c + gi, d[h], yh, p, ns);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *isa_used(PyObject *self, PyObject *args) {
    int isa_cap;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &isa_cap)) return NULL;
    return PyLong_FromLong(isa_level(isa_cap));
}

static PyMethodDef methods[] = {
    {"gated_delta_step", gated_delta_step, METH_VARARGS,
     "Gated DeltaNet's one-token step in place on state slots."},
    {"ssd_step", ssd_step, METH_VARARGS, "Mamba2's one-token SSD step in place on state slots."},
    {"isa_used", isa_used, METH_VARARGS, "The body the kernels run under a cap: 2, 1 or 0."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_recurrent_step",
                                    "The recurrent layers' CPU decode step.", -1, methods};

PyMODINIT_FUNC PyInit__recurrent_step(void) { return PyModule_Create(&module); }
