/* The Python side of a GEMM's side rows (gemm_panels.h side_rows), one copy per extension
 * that includes it (_bf16_ops, _int8_ops): prefetch_rows_next(k, v, row_bytes, slots, n)
 * sets the rows the calling thread's next linear call prefetches as it multiplies; that call
 * takes them (take_side_rows), whatever its body, so a job never outlives one call. */
#ifndef KVSTRATA_SIDE_ROWS_H
#define KVSTRATA_SIDE_ROWS_H
#ifdef _OPENMP
#include <omp.h>
#endif
#include "gemm_panels.h"

static __thread side_rows pending_side;

static inline side_rows take_side_rows(void) {
    const side_rows job = pending_side;
    pending_side.s_end = 0;
    return job;
}

static PyObject *prefetch_rows_next(PyObject *self, PyObject *args) {
    unsigned long long k_addr, v_addr, slots_addr;
    Py_ssize_t row_bytes, n;
    if (!PyArg_ParseTuple(args, "KKnKn", &k_addr, &v_addr, &row_bytes, &slots_addr, &n))
        return NULL;
    if (row_bytes < 1 || n < 0 || (n && !slots_addr)) {
        PyErr_Format(PyExc_ValueError, "bad rows: row_bytes=%zd n=%zd", row_bytes, n);
        return NULL;
    }
    pending_side = (side_rows){(const char *)k_addr, (const char *)v_addr,
                               (const int64_t *)slots_addr, row_bytes, 0, n, 0};
    Py_RETURN_NONE;
}

static PyObject *rows_pending(PyObject *self, PyObject *args) {
    return PyLong_FromSsize_t((Py_ssize_t)(pending_side.s_end - pending_side.s));
}

/* This thread's share of a call's job (inside its OpenMP region), or an empty one. */
static inline side_rows side_of_thread(const side_rows *job) {
#ifdef _OPENMP
    return side_share(job, omp_get_thread_num(), omp_get_num_threads());
#else
    return *job;
#endif
}

#define SIDE_ROWS_METHODS                                                                   \
    {"prefetch_rows_next", prefetch_rows_next, METH_VARARGS,                                \
     "Rows (k, v, row_bytes, slots, n) this thread's next linear call prefetches as it runs."}, \
    {"rows_pending", rows_pending, METH_NOARGS,                                             \
     "How many slots prefetch_rows_next left for this thread's next linear call (tests)."},
#endif
