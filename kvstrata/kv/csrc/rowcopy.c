/* Scatter-gather copy of pages between two CPU buffers: the CPU side of HiCache's `kernel` IO
 * backend (kvstrata/kv/rowcopy.py wraps it; see that file for the why).
 *
 *   copy_pages(dst, dst_nbytes, src, src_nbytes, dst_pages, src_pages, n_pages,
 *              dst_rows, src_rows, rows_per_page, row_bytes, streaming)
 *   scatter_kv(...)   a forward's new K and V rows into one layer of the device pool (below)
 *   row_prefixes(...) the first lens[i] entries of rows[i] of req_to_token, concatenated
 *
 * Page i moves rows_per_page rows of row_bytes each:
 *   dst + dst_pages[i] + dst_rows[r]  <-  src + src_pages[i] + src_rows[r]
 * dst_pages/src_pages/dst_rows/src_rows are addresses of int64 byte offsets. A page's rows are
 * the same pattern on every page, so the offsets cost n_pages + rows_per_page words instead of
 * one per row, and pages are finished one at a time (both sides stay within a few hundred KiB).
 * Every offset is checked against its buffer before any byte moves, so a bad index raises
 * IndexError instead of corrupting memory. The GIL is released while copying: the transfer
 * worker copies while the scheduler thread runs.
 *
 * Why not memcpy per row: glibc's memcpy switches to non-temporal stores only for large single
 * copies, so a loop of 0.25-12 KiB row memcpys pays a read-for-ownership of every destination
 * line and measured 0.6-0.7 of one big memcpy here; streaming stores bring it to ~1.0.
 * `streaming` is off for small transfers, whose destination is read again soon.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* The source prefetch runs this many bytes ahead of the copy, across row boundaries: rows
 * are scattered, so the hardware prefetcher restarts at every row. Into L2 (T1), not L1:
 * measured on scattered 12 KiB source rows, none 0.62, 1-4 KiB into L1 0.66-0.70, 8 KiB into
 * L2 0.86-1.02 of memcpy (benchmarks/bench_transfer.py, d2h). */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 8192
#endif

typedef struct {
    char *dst;
    const char *src;
    const int64_t *dpage, *spage, *drow, *srow;
    Py_ssize_t n, rows;
    int64_t row;
} plan;

static int span(const int64_t *a, Py_ssize_t n, int64_t *lo, int64_t *hi) {
    *lo = INT64_MAX; *hi = INT64_MIN;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (a[i] < *lo) *lo = a[i];
        if (a[i] > *hi) *hi = a[i];
    }
    return n > 0;
}

static int check_side(const int64_t *pages, Py_ssize_t n, const int64_t *rows, Py_ssize_t r,
                      int64_t row, int64_t nbytes, const char *which) {
    int64_t plo, phi, rlo, rhi;
    if (!span(pages, n, &plo, &phi) || !span(rows, r, &rlo, &rhi)) return 0;
    if (plo < 0 || rlo < 0 || phi > nbytes || rhi > nbytes - row || phi > nbytes - row - rhi) {
        PyErr_Format(PyExc_IndexError, "%s: page offsets %lld..%lld plus row offsets %lld..%lld "
                     "(rows of %lld bytes) fall outside the buffer (%lld bytes)", which,
                     (long long)plo, (long long)phi, (long long)rlo, (long long)rhi,
                     (long long)row, (long long)nbytes);
        return -1;
    }
    return 0;
}

static void copy_plain(const plan *p) {
    for (Py_ssize_t i = 0; i < p->n; i++) {
        char *d = p->dst + p->dpage[i];
        const char *s = p->src + p->spage[i];
        for (Py_ssize_t r = 0; r < p->rows; r++)
            memcpy(d + p->drow[r], s + p->srow[r], (size_t)p->row);
    }
}

#if defined(__SSE2__)
typedef struct { Py_ssize_t i, r; int64_t j; } cursor;

static inline void prefetch_next(const plan *p, cursor *c) {
    if (c->i >= p->n) return;
    _mm_prefetch(p->src + p->spage[c->i] + p->srow[c->r] + c->j, _MM_HINT_T1);
    c->j += 64;
    if (c->j >= p->row) {
        c->j = 0;
        if (++c->r == p->rows) { c->r = 0; c->i++; }
    }
}

static void copy_streaming(const plan *p) {
    cursor pf = {0, 0, 0};
    for (int k = 0; k < PREFETCH_AHEAD / 64; k++) prefetch_next(p, &pf);
    for (Py_ssize_t i = 0; i < p->n; i++) {
        char *dp = p->dst + p->dpage[i];
        const char *sp = p->src + p->spage[i];
        for (Py_ssize_t r = 0; r < p->rows; r++) {
            char *d = dp + p->drow[r];
            const char *s = sp + p->srow[r];
            int64_t j = 0;
            for (; j + 64 <= p->row; j += 64) {
                prefetch_next(p, &pf);
                __m128i a = _mm_loadu_si128((const __m128i *)(s + j));
                __m128i b = _mm_loadu_si128((const __m128i *)(s + j + 16));
                __m128i c = _mm_loadu_si128((const __m128i *)(s + j + 32));
                __m128i e = _mm_loadu_si128((const __m128i *)(s + j + 48));
                _mm_stream_si128((__m128i *)(d + j), a);
                _mm_stream_si128((__m128i *)(d + j + 16), b);
                _mm_stream_si128((__m128i *)(d + j + 32), c);
                _mm_stream_si128((__m128i *)(d + j + 48), e);
            }
            for (; j < p->row; j += 16)  /* row is a multiple of 16 when streaming */
                _mm_stream_si128((__m128i *)(d + j), _mm_loadu_si128((const __m128i *)(s + j)));
        }
    }
    _mm_sfence();  /* order the streamed stores before anyone reads them */
}
#endif

static int all_aligned(const int64_t *a, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (a[i] % 16) return 0;
    return 1;
}

static PyObject *copy_pages(PyObject *self, PyObject *args) {
    unsigned long long dst_addr, src_addr, dpage, spage, drow, srow;
    long long dst_nbytes, src_nbytes, row;
    Py_ssize_t n, rows;
    int streaming;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLKLKKnKKnLp", &dst_addr, &dst_nbytes, &src_addr, &src_nbytes,
                          &dpage, &spage, &n, &drow, &srow, &rows, &row, &streaming))
        return NULL;
    if (n < 0 || rows < 0 || row <= 0) {
        PyErr_Format(PyExc_ValueError, "need n_pages >= 0, rows_per_page >= 0 and row_bytes > 0, "
                     "got %zd, %zd, %lld", n, rows, row);
        return NULL;
    }
    plan p = {(char *)(uintptr_t)dst_addr, (const char *)(uintptr_t)src_addr,
              (const int64_t *)(uintptr_t)dpage, (const int64_t *)(uintptr_t)spage,
              (const int64_t *)(uintptr_t)drow, (const int64_t *)(uintptr_t)srow, n, rows, row};
    if (check_side(p.dpage, n, p.drow, rows, row, dst_nbytes, "destination") < 0
            || check_side(p.spage, n, p.srow, rows, row, src_nbytes, "source") < 0)
        return NULL;
    int stream = 0;
#if defined(__SSE2__)
    /* Streaming stores need every destination row 16-byte aligned. */
    stream = streaming && dst_addr % 16 == 0 && row % 16 == 0 && all_aligned(p.dpage, n)
             && all_aligned(p.drow, rows);
#else
    (void)streaming; (void)all_aligned;  /* no streaming path written for this architecture */
#endif
    Py_BEGIN_ALLOW_THREADS
#if defined(__SSE2__)
    if (stream)
        copy_streaming(&p);
    else
#endif
        copy_plain(&p);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(stream);
}

/* scatter_kv(k_plane, v_plane, plane_rows, row_bytes, slots, n, k, k_stride, v, v_stride):
 * token i's K row (row_bytes at k + i * k_stride) to k_plane + slots[i] * row_bytes, and its V
 * row likewise: one layer's new keys and values written into the device pool in one call (a
 * decode step wrote them with two index_copy_ calls per layer, ~12-17 us each at batch 32,
 * ~0.8 ms of a SmolLM2 step). Every slot is checked against plane_rows first. */
static PyObject *scatter_kv(PyObject *self, PyObject *args) {
    unsigned long long kp, vp, slots_addr, k_addr, v_addr;
    long long plane_rows, row, k_stride, v_stride;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKLLKnKLKL", &kp, &vp, &plane_rows, &row, &slots_addr, &n,
                          &k_addr, &k_stride, &v_addr, &v_stride))
        return NULL;
    if (n < 0 || row <= 0 || k_stride < row || v_stride < row) {
        PyErr_Format(PyExc_ValueError, "need n >= 0, row_bytes > 0 and strides >= row_bytes, "
                     "got %zd, %lld, %lld, %lld", n, row, k_stride, v_stride);
        return NULL;
    }
    const int64_t *slots = (const int64_t *)(uintptr_t)slots_addr;
    for (Py_ssize_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= plane_rows) {
            PyErr_Format(PyExc_IndexError, "slot %lld outside the pool (%lld slots)",
                         (long long)slots[i], plane_rows);
            return NULL;
        }
    char *kd = (char *)(uintptr_t)kp, *vd = (char *)(uintptr_t)vp;
    const char *ks = (const char *)(uintptr_t)k_addr, *vs = (const char *)(uintptr_t)v_addr;
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(kd + slots[i] * row, ks + i * k_stride, (size_t)row);
        memcpy(vd + slots[i] * row, vs + i * v_stride, (size_t)row);
    }
    Py_RETURN_NONE;
}

/* out = table[rows[0], :lens[0]] ++ table[rows[1], :lens[1]] ++ ... for an int64 table of
 * n_rows x row_len: a decode batch's key slots for the paged attention kernel. torch's
 * table[rows, :longest][mask] measured ~0.85 ms at 32 rows x 191 (the boolean select alone
 * ~0.7 ms), this ~0.01 ms. Every row and length is checked before anything is written. */
static PyObject *row_prefixes(PyObject *self, PyObject *args) {
    unsigned long long table_addr, rows_addr, lens_addr, out_addr;
    long long n_rows, row_len, out_len;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLLKKnKL", &table_addr, &n_rows, &row_len, &rows_addr,
                          &lens_addr, &n, &out_addr, &out_len))
        return NULL;
    const int64_t *rows = (const int64_t *)(uintptr_t)rows_addr;
    const int64_t *lens = (const int64_t *)(uintptr_t)lens_addr;
    long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= n_rows || lens[i] < 0 || lens[i] > row_len) {
            PyErr_Format(PyExc_IndexError, "row %lld / length %lld outside the table (%lld "
                         "rows of %lld)", (long long)rows[i], (long long)lens[i], n_rows,
                         row_len);
            return NULL;
        }
        total += lens[i];
    }
    if (n < 0 || total != out_len) {
        PyErr_Format(PyExc_ValueError, "out holds %lld entries, the rows' lengths sum to %lld",
                     out_len, total);
        return NULL;
    }
    const int64_t *table = (const int64_t *)(uintptr_t)table_addr;
    int64_t *out = (int64_t *)(uintptr_t)out_addr;
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(out, table + rows[i] * row_len, (size_t)lens[i] * sizeof(int64_t));
        out += lens[i];
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"row_prefixes", row_prefixes, METH_VARARGS,
     "row_prefixes(table, n_rows, row_len, rows, lens, n, out, out_len)"},
    {"scatter_kv", scatter_kv, METH_VARARGS,
     "scatter_kv(k_plane, v_plane, plane_rows, row_bytes, slots, n, k, k_stride, v, v_stride)"},
    {"copy_pages", copy_pages, METH_VARARGS,
     "copy_pages(dst, dst_nbytes, src, src_nbytes, dst_pages, src_pages, n_pages, dst_rows, "
     "src_rows, rows_per_page, row_bytes, streaming) -> whether streaming stores were used"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcopy",
                                    "Scatter-gather page copies between CPU buffers.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__rowcopy(void) { return PyModule_Create(&module); }
