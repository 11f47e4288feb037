/* kvstrata's own bf16 linear for a bf16 model on an AMX-BF16 CPU (bf16_gemm_amx.h), an
 * AVX512-BF16 one, and an AVX2 + FMA one (bf16_gemm_avx2.h) (runner/cpu/packed_linear.py wraps it).
 *
 *   linear(x, x_row_stride, rows, k, w, n, bias, out, silu, out_f32, threads, isa_cap)
 *       out[r, j] = bf16(sum_q x[r, q] * W[j, q] (+ bias[j])), fp32 accumulation, one rounding;
 *       out_f32 = 1: that bf16 value widened to fp32 (an output head's logits: what
 *       F.linear(...).float() returns, without the second pass over [rows, vocab]);
 *       silu = 1 (a fused gate|up projection, n % 32 == 0): out [rows, n / 2] =
 *       bf16(bf16(silu(g)) * u) with g, u the two halves rounded to bf16 first, as
 *       cpu_ops.c silu_mul computes it from the projection's bf16 output.
 *       x bf16 rows `x_row_stride` elements apart; w packed by pack_bf16 (below); bias fp32
 *       [n] or 0; k % 2 == 0, n % 16 == 0.
 *   linear_f32(x, x_row_stride, rows, k, w, n, bias, out, threads, isa_cap)
 *       an fp32 model's linear on the AVX2 tile: out[r, j] = sum_q x[r, q] * W[j, q] + bias[j]
 *       in fp32, w in f32_gemv.h's panels ([n / 16][k][16]: what the tile reads from a bf16
 *       panel once widened), out fp32 [rows, n]; k % 2 == 0, n % 16 == 0 (f32_gemv.py).
 *   has_bf16_512(isa_cap): whether this CPU runs linear on AVX512-BF16 (KVSTRATA_CPU_ISA allows);
 *   kernel_isa(isa_cap): the body linear runs: 3 AMX-BF16 (bf16_gemm_amx.h, k % 32 == 0 and
 *       more than MR rows; AVX512-BF16 otherwise), 2 AVX512-BF16, 1 AVX2 + FMA, 0 none.
 *   isa_cap | EVERY_ROW_COUNT (linear's): the AMX tiles at every row count where they run at
 *       all, the AVX512-BF16 tiles' MR-row shortcut off: deterministic inference's fixed
 *       layers (runner/cpu/fixed_linear.py), whose rows must not depend on how many rows
 *       share the call (the two bodies sum k in different orders).
 *   linear_amx_emulated(...): linear's arguments on the AMX body's tiles emulated in memory
 *       (tests, on any AVX2 CPU).
 *
 * Why: a decode step makes ~121 linears of 1-64 rows. oneDNN's prepacked bf16 linear ran them
 * at ~59% of its own 2048^3 GEMM peak (bench_decode_step.py, 2 threads) with ~16-19 us of
 * fixed cost per call; int8_gemm.h's tiles, which replaced oneDNN's int8 linear, port to bf16
 * as they are: vdpbf16ps takes a pair of bf16 per 32-bit lane where vpdpbusd takes a quadruple
 * of bytes.
 *
 * Weight layout: the [n, k] bf16 matrix as n / 16 blocks of 16 output columns, each
 * [k / 2][16][2]: for 2 consecutive k the 16 columns' pairs side by side, one 64-byte load per
 * pair step. Tiles: up to MR rows x NR blocks (4 x 64 columns, 16 zmm accumulators); the last
 * row block and the last panel take narrower tiles (specialised at compile time), so no
 * column or row is computed twice. Work items are (panel, row block), panel-major, split
 * statically across torch's OpenMP team: a thread reuses one panel's weights across its rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "cpu_rows.h"
#include "cpu_vec.h"
#include "gemm_panels.h"
#include "side_rows.h"

typedef struct {
    const uint16_t *x; /* [m] rows, stride elements apart */
    int64_t stride;
    const uint16_t *w; /* packed blocks */
    const float *bias; /* [n] or NULL */
    char *out;         /* [m, n] or [m, n / 2] (silu), bf16 or (f32_out) fp32 */
    int64_t m, k, n;
    int silu, f32_out;
} gemm_args;

typedef struct { /* linear_f32: an fp32 model's rows x its weights in f32_gemv.h's panels */
    const float *x; /* [m] rows, stride elements apart */
    int64_t stride;
    const float *w; /* [n / 16][k][16] */
    const float *bias; /* [n] or NULL */
    float *out;        /* [m, n] */
    int64_t m, k, n;
} f32_gemm_args;

#if defined(__x86_64__)
#define BF16_512 KVS_TARGET("avx512f,avx512bw,avx512bf16")
#define ALWAYS_INLINE inline __attribute__((always_inline))

BF16_512 static ALWAYS_INLINE __m512 add_bias(__m512 v, const float *bias, int64_t c0) {
    return bias ? _mm512_add_ps(v, _mm512_loadu_ps(bias + c0)) : v;
}

/* One tile of mr rows x nr blocks (both compile-time constants at each call site). */
BF16_512 static ALWAYS_INLINE void tile(const gemm_args *g, int64_t r0, const int64_t blk[NR],
                                        prefetch_plan *pf, const int mr, const int nr) {
    __m512 c[MR][NR];
    const uint16_t *w[NR];
    const uint16_t *a[MR];
    const int64_t k = g->k;
#pragma GCC unroll 4
    for (int j = 0; j < nr; j++) w[j] = g->w + blk[j] * k * BLOCK;
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++) a[i] = g->x + (r0 + i) * g->stride;
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) c[i][j] = _mm512_setzero_ps();
    for (int64_t q = 0; q < k; q += 2) {
        prefetch_due(pf, q / 2);
        __m512bh b[NR];
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++)
            b[j] = (__m512bh)_mm512_loadu_si512((const void *)(w[j] + q * BLOCK));
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            int32_t pair;
            memcpy(&pair, a[i] + q, 4);
            const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
            for (int j = 0; j < nr; j++) c[i][j] = _mm512_dpbf16_ps(c[i][j], av, b[j]);
        }
    }
    const int64_t half_n = g->n / 2;
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++) {
        const int64_t r = r0 + i;
        if (!g->silu) {
#pragma GCC unroll 4
            for (int j = 0; j < nr; j++) {
                const int64_t c0 = blk[j] * BLOCK;
                const __m512 v = add_bias(c[i][j], g->bias, c0);
                if (g->f32_out)
                    _mm512_storeu_ps((float *)g->out + r * g->n + c0, bf16x16_round(v));
                else
                    _mm256_storeu_si256((__m256i *)((uint16_t *)g->out + r * g->n + c0),
                                        bf16x16_from(v));
            }
            continue;
        }
#pragma GCC unroll 2
        for (int j = 0; j < nr / 2; j++) {
            const int64_t c0 = blk[j] * BLOCK;
            __m512 gv = bf16x16_round(add_bias(c[i][j], g->bias, c0));
            __m512 uv = bf16x16_round(add_bias(c[i][nr / 2 + j], g->bias, half_n + c0));
            __m512 act = bf16x16_round(silu_v(gv));
            _mm256_storeu_si256((__m256i *)((uint16_t *)g->out + r * half_n + c0),
                                bf16x16_from(_mm512_mul_ps(act, uv)));
        }
    }
}

#include "bf16_gemm_avx2.h"
#include "bf16_gemm_amx.h"

#define TILE_ROWS(MRV)                                  \
    switch (nr) {                                       \
    case 4: tile(g, r0, blk, pf, MRV, 4); return;       \
    case 3: tile(g, r0, blk, pf, MRV, 3); return;       \
    case 2: tile(g, r0, blk, pf, MRV, 2); return;       \
    default: tile(g, r0, blk, pf, MRV, 1); return;      \
    }
BF16_512 static void tile_any(const gemm_args *g, int64_t r0, const int64_t blk[NR],
                              prefetch_plan *pf, int mr, int nr) {
    switch (mr) {
    case 4: TILE_ROWS(4)
    case 3: TILE_ROWS(3)
    case 2: TILE_ROWS(2)
    default: TILE_ROWS(1)
    }
}
#endif

#define EVERY_ROW_COUNT 0x100

static int use_bf16_512(int isa_cap) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return isa_cap >= 2 && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("avx512bw");
#else
    (void)isa_cap;
    return 0;
#endif
}

/* Which body linear runs: 3 AMX-BF16 (bf16_gemm_amx.h; with AVX512-BF16 for its epilogue
 * and for k % 32 != 0), 2 AVX512-BF16, 1 AVX2 + FMA (bf16_gemm_avx2.h), 0 none. */
static int body_isa(int isa_cap) {
#ifdef KVSTRATA_AMX
    if (isa_cap >= 3 && use_bf16_512(isa_cap) && amx_ready(AMX_BF16_BIT)) return 3;
#endif
    if (use_bf16_512(isa_cap)) return 2;
#if defined(__x86_64__)
    if (isa_cap >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return 1;
#endif
    return 0;
}

/* Row block rb of nrb over `rows`: its first row (*r0) and height. even (the AVX2 tile): the
 * blocks as even as mr_max allows (20 rows: 4 x 5, not 3 x 6 + 2), since a 1-2 row tile has
 * 2-4 accumulator chains, which the FMA latency, not the ports, paces; else mr_max rows each
 * and the last what is left. */
static inline int row_block(int64_t rows, int64_t nrb, int64_t rb, int64_t mr_max, int even,
                            int64_t *r0) {
    if (!even) {
        *r0 = rb * mr_max;
        return (int)(rows - *r0 < mr_max ? rows - *r0 : mr_max);
    }
    const int64_t base = rows / nrb, extra = rows % nrb;
    *r0 = rb * base + (rb < extra ? rb : extra);
    return (int)(base + (rb < extra));
}

/* linear, or (emulate_amx) linear on bf16_gemm_amx.h's emulated tiles: a test's. */
static PyObject *linear_impl(PyObject *args, int emulate_amx) {
    unsigned long long x_addr, w_addr, b_addr, o_addr;
    Py_ssize_t stride, rows, k, n;
    int silu, f32_out, threads, isa_cap;
    /* this call's side rows, if its caller set one: taken first, so no job outlives a call
     * that fails (its slot list may be gone by the next) */
    const side_rows job = take_side_rows();
    if (!PyArg_ParseTuple(args, "KnnnKnKKiiii", &x_addr, &stride, &rows, &k, &w_addr, &n,
                          &b_addr, &o_addr, &silu, &f32_out, &threads, &isa_cap))
        return NULL;
    if (rows < 0 || k < 2 || k % 2 || stride < k || n < BLOCK ||
        n % (silu ? 2 * BLOCK : BLOCK) || (silu && f32_out)) {
        PyErr_Format(PyExc_ValueError, "bad shape: rows=%zd k=%zd n=%zd stride=%zd silu=%d "
                     "out_f32=%d", rows, k, n, stride, silu, f32_out);
        return NULL;
    }
    const int every_row_count = (isa_cap & EVERY_ROW_COUNT) != 0;
    isa_cap &= ~EVERY_ROW_COUNT;
    int body = body_isa(isa_cap);
#ifdef KVSTRATA_AMX
    /* Up to MR rows (one row block of the AVX512-BF16 tile, which streams the weights once
     * as the tiles do, without their padded rows and configuration) the AVX512-BF16 body:
     * at one row it took a decode step's 120 GEMMs in 6.16 ms against the tiles' 6.99 (16
     * cores of an H200 host's Xeon, 2026-12-04), at 8 rows 7.87 against 7.75. Not for a
     * fixed layer (every_row_count): its rows must sum k in one order at any row count. */
    if (emulate_amx || (body == 3 && k % AMX_K == 0 && (rows > MR || every_row_count))) {
        gemm_args a = {(const uint16_t *)x_addr, stride, (const uint16_t *)w_addr,
                       (const float *)b_addr, (char *)o_addr, rows, k, n, silu != 0,
                       f32_out != 0};
        if (emulate_amx && (k % AMX_K || body_isa(1) != 1)) {
            PyErr_SetString(PyExc_ValueError, "the emulated AMX tiles need k % 32 == 0, AVX2");
            return NULL;
        }
        const int mode = !emulate_amx ? AMX_HW : body >= 2 ? AMX_EMU_512 : AMX_EMU;
        if (rows && amx_linear(&a, threads, mode)) return PyErr_NoMemory();
        Py_RETURN_NONE;
    }
    if (body == 3) body = 2; /* k % 32 != 0, or few rows: the AVX512-BF16 tiles */
#else
    if (emulate_amx) {
        PyErr_SetString(PyExc_RuntimeError, "built without the AMX body (x86-64 Linux only)");
        return NULL;
    }
#endif
    if (!body) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this CPU (or KVSTRATA_CPU_ISA) has neither AVX512-BF16 nor AVX2 + FMA");
        return NULL;
    }
#if defined(__x86_64__)
    gemm_args g = {(const uint16_t *)x_addr, stride, (const uint16_t *)w_addr,
                   (const float *)b_addr, (char *)o_addr, rows, k, n, silu != 0,
                   f32_out != 0};
    const int64_t mr_max = body == 1 ? MR_AVX2 : MR; /* rows per tile */
    const int64_t nrb = (rows + mr_max - 1) / mr_max, items = panel_count(n, g.silu) * nrb;
    const int nt = thread_count(threads, items, (int64_t)n * k * 2);
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
    {
        /* AVX2: this thread's rows widened to fp32 (bf16_gemm_avx2.h) */
        float *xf = body == 1 ? malloc(sizeof(float) * MR_AVX2 * k) : NULL;
        const int widen = body == 1 && nrb >= WIDEN_MIN_ROW_BLOCKS;
        float *wf = widen ? malloc(sizeof(float) * NR * BLOCK * k) : NULL;
        int64_t widened = -1; /* the panel wf holds */
        side_rows side = side_of_thread(&job);
        failed = (body == 1 && xf == NULL) || (widen && wf == NULL);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            if (failed) continue;
            const int64_t p = it / nrb;
            int64_t r0, blk[NR];
            const int mr = row_block(rows, nrb, it % nrb, mr_max, body == 1, &r0);
            const int nr = panel_blocks(n, g.silu, p, blk);
            prefetch_plan pf = plan_next_panel((const char *)g.w, k * BLOCK * 2, n, g.silu, p,
                                               it % nrb, nrb);
            if (body == 1 && nrb <= STREAM_MAX_ROW_BLOCKS) /* bf16_gemm_avx2.h */
                pf = (prefetch_plan){{NULL}, 0, INT64_MAX, 1, STREAM_AHEAD, NULL};
            pf.side = side.s < side.s_end ? &side : NULL;
            if (wf && widened != p) {
                widen_panel_avx2(g.w, k, blk, nr, wf);
                widened = p;
            }
            if (body == 1)
                tile_avx2(&g, r0, blk, &pf, mr, nr, xf, wf);
            else
                tile_any(&g, r0, blk, &pf, mr, nr);
        }
        free(xf);
        free(wf);
    }
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
#endif
    Py_RETURN_NONE;
}

static PyObject *linear(PyObject *self, PyObject *args) { return linear_impl(args, 0); }
static PyObject *linear_amx_emulated(PyObject *self, PyObject *args) {
    return linear_impl(args, 1);
}

static PyObject *linear_f32(PyObject *self, PyObject *args) {
    unsigned long long x_addr, w_addr, b_addr, o_addr;
    Py_ssize_t stride, rows, k, n;
    int threads, isa_cap;
    if (!PyArg_ParseTuple(args, "KnnnKnKKii", &x_addr, &stride, &rows, &k, &w_addr, &n,
                          &b_addr, &o_addr, &threads, &isa_cap))
        return NULL;
    if (rows < 0 || k < 2 || k % 2 || stride < k || n < BLOCK || n % BLOCK) {
        PyErr_Format(PyExc_ValueError, "bad shape: rows=%zd k=%zd n=%zd stride=%zd", rows, k,
                     n, stride);
        return NULL;
    }
    if (body_isa(isa_cap) < 1) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU (or KVSTRATA_CPU_ISA) has no AVX2 + FMA");
        return NULL;
    }
#if defined(__x86_64__)
    const f32_gemm_args g = {(const float *)x_addr, stride, (const float *)w_addr,
                             (const float *)b_addr, (float *)o_addr, rows, k, n};
    const int64_t nrb = (rows + MR_AVX2 - 1) / MR_AVX2, items = panel_count(n, 0) * nrb;
    const int nt = thread_count(threads, items, (int64_t)n * k * 4);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t it = 0; it < items; it++) { /* panel-major, as linear's */
        const int64_t p = it / nrb;
        int64_t r0, blk[NR];
        const int mr = row_block(rows, nrb, it % nrb, MR_AVX2, 1, &r0);
        const int nr = panel_blocks(n, 0, p, blk);
        prefetch_plan pf = plan_next_panel((const char *)g.w, k * BLOCK * 4, n, 0, p,
                                           it % nrb, nrb);
        tile_f32_avx2(&g, r0, blk, &pf, mr, nr);
    }
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

static PyObject *has_bf16_512(PyObject *self, PyObject *args) {
    int isa_cap;
    if (!PyArg_ParseTuple(args, "i", &isa_cap)) return NULL;
    return PyBool_FromLong(use_bf16_512(isa_cap & ~EVERY_ROW_COUNT));
}

static PyObject *kernel_isa(PyObject *self, PyObject *args) {
    int isa_cap;
    if (!PyArg_ParseTuple(args, "i", &isa_cap)) return NULL;
    return PyLong_FromLong(body_isa(isa_cap & ~EVERY_ROW_COUNT));
}

static PyMethodDef methods[] = {
    {"linear", linear, METH_VARARGS,
     "bf16 rows x packed bf16 weight (AVX512-BF16 or AVX2 + FMA), bf16 out."},
    {"linear_amx_emulated", linear_amx_emulated, METH_VARARGS,
     "linear's arguments, run on the AMX body's tiles emulated in memory (tests)."},
    {"linear_f32", linear_f32, METH_VARARGS,
     "fp32 rows x fp32 weights in f32_gemv.h's panels on the AVX2 tile, fp32 out."},
    SIDE_ROWS_METHODS
    {"has_bf16_512", has_bf16_512, METH_VARARGS, "Whether linear runs on AVX512-BF16 here."},
    {"kernel_isa", kernel_isa, METH_VARARGS,
     "linear's body here: 3 AMX-BF16, 2 AVX512-BF16, 1 AVX2 + FMA, 0 none (it raises)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bf16_ops",
                                    "kvstrata's bf16 GEMM for small-batch linears.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__bf16_ops(void) { return PyModule_Create(&module); }
