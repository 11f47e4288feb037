/* kvstrata's GEMM over GGUF weight blocks kept packed (runner/cpu/gguf_matmul.py wraps it):
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K rows as the GGUF file stores them,
 * dequantized 32 weights at a time in registers (gguf_blocks_avx2.h), fp32 rows of x, fp32 out.
 *
 *   matmul(qtype, w, row_bytes, n, k, x, m, out, out_stride, threads, isa_cap)
 *       out[r * out_stride + j] = sum_q x[r * k + q] * W[j, q], W the exact fp32 values
 *       gguf.quants.dequantize gives; every output summed in one order whatever m and the
 *       thread split: one ymm accumulator per output, an FMA per 8 k in order from k = 0,
 *       then gg_hsum's fixed tree. So row r of a call equals row r of any other call on the
 *       same rows, bit for bit (batch invariance, deterministic inference).
 *   matmul_q8(same arguments): the same product with each row of x quantized to 8-bit blocks
 *       and integer dot products (gguf_q8_blocks.h, gguf_q8_run.h): what the layers run.
 *   dequantize(qtype, w, row_bytes, n, k, out, threads, isa_cap): W into fp32 [n, k].
 *   has_avx2(isa_cap): whether this CPU runs the AVX2 body (KVSTRATA_CPU_ISA allowing);
 *   has_vnni(isa_cap): whether matmul_q8 takes its AVX-512 VNNI body (vpdpbusd; same bits);
 *   without it the portable body (gguf_blocks_scalar.h) gives the same bits, slowly.
 *
 * Work: rows in blocks of ROW_BLOCK; in each, output columns in quads, chunks of quads claimed
 * by the caller and kvstrata's worker threads up to POOL_MAX_ROWS rows (gguf_pool.h: the caller
 * never waits for a worker that has not started), split statically over torch's OpenMP team
 * above; each output computed whole by one thread. Up to DIRECT_MAX_ROWS rows
 * (batch-1 and batch-2 decode) a quad's groups are dequantized and multiplied straight from
 * registers: the packed bytes stream once. Above, a thread dequantizes its quad once into a
 * per-thread fp32 panel [4][k] (in L2) and multiplies tiles of TILE_ROWS rows x 4 columns
 * from it, so the dequantization is paid once per ROW_BLOCK rows, not once per row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include "cpu_rows.h"
#include "gguf_blocks_avx2.h"
#include "gguf_blocks_scalar.h"
#include "gguf_pool.h"
#include "gguf_q8_run.h"

#define QUAD 4
#define DIRECT_MAX_ROWS 2
#define TILE_ROWS 3
#define ROW_BLOCK 64

typedef struct {
    const uint8_t *w;
    int64_t row_bytes, n, k;
    const float *x; /* [m, k] */
    float *out;
    int64_t out_stride;
} gg_args;

/* The 8-bit-activation body on AVX-512 VNNI (gguf_q8_tiles.h's vnni instance): the CPU has
 * it and KVSTRATA_CPU_ISA allows AVX-512 (the AVX2 body's bits either way). */
static int use_vnni_body(int isa_cap) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return isa_cap >= 2 && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
#else
    (void)isa_cap;
    return 0;
#endif
}

static int use_avx2_body(int isa_cap) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return isa_cap >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    (void)isa_cap;
    return 0;
#endif
}

#if defined(__x86_64__)
/* Columns j0.. (nc of them) x rows r0.. (mr <= DIRECT_MAX_ROWS): each group of each column
 * dequantized in registers and multiplied into its rows' accumulators. */
GG_AVX2 static GG_INLINE void direct_tile(const int qt, const gg_args *a, int64_t r0,
                                          const int mr, int64_t j0, const int nc) {
    __m256 acc[DIRECT_MAX_ROWS][QUAD];
    const uint8_t *row[QUAD];
    for (int c = 0; c < nc; c++) row[c] = a->w + (j0 + c) * a->row_bytes;
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t groups = a->k / 32;
    for (int64_t g = 0; g < groups; g++) {
        for (int c = 0; c < nc; c++) {
            __m256 v[4];
            gg_group(qt, row[c], g, v);
            for (int r = 0; r < mr; r++) {
                const float *xr = a->x + (r0 + r) * a->k + g * 32;
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++)
                    acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * i), v[i], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++)
            a->out[(r0 + r) * a->out_stride + j0 + c] = gg_hsum(acc[r][c]);
}

/* Columns j0.. (nc) of the panel: their dequantized weights, [QUAD][k] fp32. */
GG_AVX2 static GG_INLINE void fill_panel(const int qt, const gg_args *a, int64_t j0,
                                         const int nc, float *panel) {
    const int64_t groups = a->k / 32;
    for (int c = 0; c < nc; c++) {
        const uint8_t *row = a->w + (j0 + c) * a->row_bytes;
        float *dst = panel + c * a->k;
        for (int64_t g = 0; g < groups; g++) {
            __m256 v[4];
            gg_group(qt, row, g, v);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + g * 32 + 8 * i, v[i]);
        }
    }
}

/* mr rows x nc columns of the panel, the same FMAs in the same order as direct_tile. */
GG_AVX2 static GG_INLINE void panel_tile(const gg_args *a, const float *panel, int64_t r0,
                                         const int mr, int64_t j0, const int nc) {
    __m256 acc[TILE_ROWS][QUAD];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = _mm256_setzero_ps();
    const float *xr = a->x + r0 * a->k;
    for (int64_t q = 0; q < a->k; q += 8) {
        __m256 xv[TILE_ROWS];
        for (int r = 0; r < mr; r++) xv[r] = _mm256_loadu_ps(xr + r * a->k + q);
        for (int c = 0; c < nc; c++) {
            const __m256 wv = _mm256_loadu_ps(panel + c * a->k + q);
            for (int r = 0; r < mr; r++) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++)
            a->out[(r0 + r) * a->out_stride + j0 + c] = gg_hsum(acc[r][c]);
}

/* Constant row and column counts at each call, so the tiles' loops unroll into registers. */
#define DIRECT_COLS(MR)                                                 \
    switch (nc) {                                                       \
    case 4: direct_tile(qt, a, r0, MR, j0, 4); return;                  \
    case 3: direct_tile(qt, a, r0, MR, j0, 3); return;                  \
    case 2: direct_tile(qt, a, r0, MR, j0, 2); return;                  \
    default: direct_tile(qt, a, r0, MR, j0, 1); return;                 \
    }
#define PANEL_COLS(MR)                                                  \
    switch (nc) {                                                       \
    case 4: panel_tile(a, panel, r0, MR, j0, 4); return;                \
    case 3: panel_tile(a, panel, r0, MR, j0, 3); return;                \
    case 2: panel_tile(a, panel, r0, MR, j0, 2); return;                \
    default: panel_tile(a, panel, r0, MR, j0, 1); return;               \
    }

GG_AVX2 static GG_INLINE void direct_any(const int qt, const gg_args *a, int64_t r0, int mr,
                                         int64_t j0, int nc) {
    if (mr == 2) DIRECT_COLS(2)
    DIRECT_COLS(1)
}

GG_AVX2 static void panel_any(const gg_args *a, const float *panel, int64_t r0, int mr,
                              int64_t j0, int nc) {
    if (mr == 3) PANEL_COLS(3)
    if (mr == 2) PANEL_COLS(2)
    PANEL_COLS(1)
}

/* Quad jq of rows [r0, r0 + rows): direct up to DIRECT_MAX_ROWS rows, else through a panel. */
GG_AVX2 static GG_INLINE void quad_rows(const int qt, const gg_args *a, int64_t r0,
                                        int64_t rows, int64_t jq, float *panel) {
    const int64_t j0 = jq * QUAD;
    const int nc = (int)(a->n - j0 < QUAD ? a->n - j0 : QUAD);
    if (rows <= DIRECT_MAX_ROWS) {
        direct_any(qt, a, r0, (int)rows, j0, nc);
        return;
    }
    fill_panel(qt, a, j0, nc, panel);
    for (int64_t r = 0; r < rows; r += TILE_ROWS)
        panel_any(a, panel, r0 + r, (int)(rows - r < TILE_ROWS ? rows - r : TILE_ROWS), j0, nc);
}

/* One call's work for the pool (gguf_pool.h): a chunk is quads q0..q1 of rows r0..r1. */
typedef struct {
    const gg_args *a;
    pool_grid grid;
    float *panels; /* one [QUAD][k] panel per thread above DIRECT_MAX_ROWS rows, else NULL */
} gg_job;

/* One format's whole call (qt a literal in each instance). */
#define GG_RUN(QT, NAME)                                                                    \
    GG_AVX2 static void NAME##_chunk(const void *job, int64_t c, int worker) {               \
        const gg_job *j = job;                                                              \
        int64_t r0, r1, q0, q1;                                                             \
        pool_grid_at(&j->grid, c, &r0, &r1, &q0, &q1);                                      \
        float *panel = j->panels ? j->panels + (int64_t)worker * QUAD * j->a->k : NULL;     \
        for (int64_t jq = q0; jq < q1; jq++) quad_rows(QT, j->a, r0, r1 - r0, jq, panel);   \
    }                                                                                       \
    static int NAME(const gg_args *a, int64_t m, int threads) {                             \
        const int64_t quads = (a->n + QUAD - 1) / QUAD;                                     \
        const int nt = thread_count(threads, quads, a->row_bytes * a->n);                   \
        gg_job j = {a, pool_grid_of(m, ROW_BLOCK, quads, QUAD * a->row_bytes, nt), NULL};   \
        if (m > DIRECT_MAX_ROWS && !(j.panels = malloc(sizeof(float) * QUAD * a->k * nt)))  \
            return -1;                                                                      \
        pool_run(NAME##_chunk, &j, pool_grid_chunks(&j.grid), nt, m);                       \
        free(j.panels);                                                                     \
        return 0;                                                                           \
    }
GG_RUN(GG_Q4_0, run_q4_0)
GG_RUN(GG_Q4_1, run_q4_1)
GG_RUN(GG_Q5_0, run_q5_0)
GG_RUN(GG_Q5_1, run_q5_1)
GG_RUN(GG_Q8_0, run_q8_0)
GG_RUN(GG_Q4_K, run_q4_k)
GG_RUN(GG_Q5_K, run_q5_k)
GG_RUN(GG_Q6_K, run_q6_k)

#define GG_DEQ(QT, NAME)                                                                    \
    GG_AVX2 static void NAME(const gg_args *a, int threads) {                               \
        const int64_t quads = (a->n + QUAD - 1) / QUAD;                                     \
        const int nt = thread_count(threads, quads, a->row_bytes * a->n);                   \
        _Pragma("omp parallel for num_threads(nt) if (nt > 1) schedule(static)")            \
        for (int64_t jq = 0; jq < quads; jq++) {                                            \
            const int64_t j0 = jq * QUAD;                                                   \
            fill_panel(QT, a, j0, (int)(a->n - j0 < QUAD ? a->n - j0 : QUAD),               \
                       a->out + j0 * a->k);                                                 \
        }                                                                                   \
    }
GG_DEQ(GG_Q4_0, deq_q4_0)
GG_DEQ(GG_Q4_1, deq_q4_1)
GG_DEQ(GG_Q5_0, deq_q5_0)
GG_DEQ(GG_Q5_1, deq_q5_1)
GG_DEQ(GG_Q8_0, deq_q8_0)
GG_DEQ(GG_Q4_K, deq_q4_k)
GG_DEQ(GG_Q5_K, deq_q5_k)
GG_DEQ(GG_Q6_K, deq_q6_k)
#endif

/* The portable body (gguf_blocks_scalar.h): each output whole, the AVX2 body's bits. */
static void run_scalar(int qt, const gg_args *a, int64_t m, int threads) {
    const int nt = thread_count(threads, a->n, a->row_bytes * a->n);
    for (int64_t r = 0; r < m; r++) {
        const float *x = a->x + r * a->k;
        float *out = a->out + r * a->out_stride;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
        for (int64_t j = 0; j < a->n; j++)
            out[j] = gg_dot_scalar(qt, a->w + j * a->row_bytes, x, a->k);
    }
}

static void deq_scalar(int qt, const gg_args *a, int threads) {
    const int nt = thread_count(threads, a->n, a->row_bytes * a->n);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t j = 0; j < a->n; j++)
        for (int64_t g = 0; g < a->k / 32; g++)
            gg_group_scalar(qt, a->w + j * a->row_bytes, g, a->out + j * a->k + g * 32);
}

/* Parse and check (qtype, w, row_bytes, n, k, ...) shared by matmul and dequantize. */
static int check_shape(int qt, Py_ssize_t row_bytes, Py_ssize_t n, Py_ssize_t k) {
    const int bb = gg_block_bytes(qt), bv = gg_block_values(qt);
    if (!bb) {
        PyErr_Format(PyExc_ValueError, "GGUF quantization type %d has no kernel here", qt);
        return 0;
    }
    if (n < 1 || k < bv || k % bv || row_bytes != (k / bv) * bb) {
        PyErr_Format(PyExc_ValueError, "bad shape for type %d: n=%zd k=%zd row_bytes=%zd", qt,
                     n, k, row_bytes);
        return 0;
    }
    return 1;
}

/* matmul (float activations, q8 = 0) or matmul_q8 (8-bit activations, gguf_q8_run.h). */
static PyObject *matmul_with(PyObject *args, const int q8) {
    int qt, threads, isa_cap;
    unsigned long long w_addr, x_addr, o_addr;
    Py_ssize_t row_bytes, n, k, m, out_stride;
    if (!PyArg_ParseTuple(args, "iKnnnKnKnii", &qt, &w_addr, &row_bytes, &n, &k, &x_addr, &m,
                          &o_addr, &out_stride, &threads, &isa_cap))
        return NULL;
    if (!check_shape(qt, row_bytes, n, k)) return NULL;
    if (m < 0 || out_stride < n) {
        PyErr_Format(PyExc_ValueError, "bad rows: m=%zd out_stride=%zd n=%zd", m, out_stride, n);
        return NULL;
    }
    int failed = 0;
    const gg_args a = {(const uint8_t *)w_addr, row_bytes, n, k, (const float *)x_addr,
                       (float *)o_addr, out_stride};
    const int avx2 = use_avx2_body(isa_cap), vnni = q8 && use_vnni_body(isa_cap);
    Py_BEGIN_ALLOW_THREADS
    if (q8) failed = q8_matmul(qt, a.w, row_bytes, n, k, a.x, m, a.out, out_stride, threads, avx2,
                               avx2 && vnni);
    else if (!avx2) run_scalar(qt, &a, m, threads);
#if defined(__x86_64__)
    else switch (qt) {
    case GG_Q4_0: failed = run_q4_0(&a, m, threads); break;
    case GG_Q4_1: failed = run_q4_1(&a, m, threads); break;
    case GG_Q5_0: failed = run_q5_0(&a, m, threads); break;
    case GG_Q5_1: failed = run_q5_1(&a, m, threads); break;
    case GG_Q8_0: failed = run_q8_0(&a, m, threads); break;
    case GG_Q4_K: failed = run_q4_k(&a, m, threads); break;
    case GG_Q5_K: failed = run_q5_k(&a, m, threads); break;
    default: failed = run_q6_k(&a, m, threads); break;
    }
#endif
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *matmul(PyObject *self, PyObject *args) { return matmul_with(args, 0); }
static PyObject *matmul_q8(PyObject *self, PyObject *args) { return matmul_with(args, 1); }

static PyObject *dequantize(PyObject *self, PyObject *args) {
    int qt, threads, isa_cap;
    unsigned long long w_addr, o_addr;
    Py_ssize_t row_bytes, n, k;
    if (!PyArg_ParseTuple(args, "iKnnnKii", &qt, &w_addr, &row_bytes, &n, &k, &o_addr,
                          &threads, &isa_cap))
        return NULL;
    if (!check_shape(qt, row_bytes, n, k)) return NULL;
    const gg_args a = {(const uint8_t *)w_addr, row_bytes, n, k, NULL, (float *)o_addr, k};
    const int avx2 = use_avx2_body(isa_cap);
    Py_BEGIN_ALLOW_THREADS
    if (!avx2) deq_scalar(qt, &a, threads);
#if defined(__x86_64__)
    else switch (qt) {
    case GG_Q4_0: deq_q4_0(&a, threads); break;
    case GG_Q4_1: deq_q4_1(&a, threads); break;
    case GG_Q5_0: deq_q5_0(&a, threads); break;
    case GG_Q5_1: deq_q5_1(&a, threads); break;
    case GG_Q8_0: deq_q8_0(&a, threads); break;
    case GG_Q4_K: deq_q4_k(&a, threads); break;
    case GG_Q5_K: deq_q5_k(&a, threads); break;
    default: deq_q6_k(&a, threads); break;
    }
#endif
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *has_avx2(PyObject *self, PyObject *args) {
    int isa_cap;
    if (!PyArg_ParseTuple(args, "i", &isa_cap)) return NULL;
    return PyBool_FromLong(use_avx2_body(isa_cap));
}

static PyObject *has_vnni(PyObject *self, PyObject *args) {
    int isa_cap;
    if (!PyArg_ParseTuple(args, "i", &isa_cap)) return NULL;
    return PyBool_FromLong(use_avx2_body(isa_cap) && use_vnni_body(isa_cap));
}

static PyObject *use_pool(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    atomic_store(&pool_enabled, on);
    Py_RETURN_NONE;
}

static PyObject *pool_delays(PyObject *self, PyObject *args) {
    int worker_us, caller_us;
    if (!PyArg_ParseTuple(args, "ii", &worker_us, &caller_us)) return NULL;
    atomic_store(&pool_test_worker_us, worker_us);
    atomic_store(&pool_test_caller_us, caller_us);
    Py_RETURN_NONE;
}

static PyObject *pool_counts(PyObject *self, PyObject *args) {
    return Py_BuildValue("LL", (long long)atomic_load(&pool_g.chunks_called),
                         (long long)atomic_load(&pool_g.chunks_run));
}

static PyMethodDef methods[] = {
    {"matmul", matmul, METH_VARARGS, "fp32 rows x packed GGUF weight rows, fp32 out."},
    {"matmul_q8", matmul_q8, METH_VARARGS,
     "fp32 rows quantized to 8-bit blocks x packed GGUF weight rows, integer dots, fp32 out."},
    {"dequantize", dequantize, METH_VARARGS, "packed GGUF weight rows -> fp32 [n, k]."},
    {"has_avx2", has_avx2, METH_VARARGS, "Whether the AVX2 + FMA + F16C body runs here."},
    {"use_pool", use_pool, METH_VARARGS,
     "Whether the GEMMs split over kvstrata's pool (gguf_pool.h) or torch's OpenMP team."},
    {"pool_delays", pool_delays, METH_VARARGS,
     "Test only: pause a worker after each chunk and the caller before a call's claim word "
     "(microseconds; 0, 0 = off) -- the windows of a descheduled thread."},
    {"pool_counts", pool_counts, METH_NOARGS,
     "Test only: chunks the pool's calls asked for and chunks run, since start (equal when "
     "no call is running)."},
    {"has_vnni", has_vnni, METH_VARARGS,
     "Whether matmul_q8 runs its AVX-512 VNNI body here (the AVX2 body's bits)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gguf_ops",
                                    "kvstrata's GEMM over packed GGUF weight blocks.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__gguf_ops(void) { return PyModule_Create(&module); }
