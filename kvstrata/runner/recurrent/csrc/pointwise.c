/* Deterministic inference's transcendental element-wise ops for the recurrent layers
 * (kvstrata/runner/recurrent/pointwise.py wraps them):
 *
 *   apply(kind, x, out, n, threshold, threads)   out[i] = f(x[i]) over n contiguous floats
 *       kind 0 sigmoid  1 / (1 + exp(-x))
 *       kind 1 silu     x / (1 + exp(-x))
 *       kind 2 softplus x > threshold ? x : log1p(exp(x))      (torch's, beta 1)
 *
 * Why not torch's: torch runs an element-wise op over the flattened tensor in vector runs
 * (SLEEF's exp) with a scalar tail (libm's exp), and splits it among threads at any element,
 * so an element's bits follow its place in the batch. Here every element runs the same scalar
 * libm code whatever its index: the loop is not vectorised (-fno-tree-vectorize, and without
 * -ffast-math gcc has no vector expf to call), no implicit FMA (-ffp-contract=off), and a
 * thread split only decides which thread computes an element, not how.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

enum { SIGMOID = 0, SILU = 1, SOFTPLUS = 2 };
#define PARALLEL_MIN_ELEMENTS (1 << 16)

static PyObject *apply(PyObject *self, PyObject *args) {
    unsigned long long xa, oa;
    Py_ssize_t n;
    int kind, threads;
    double threshold;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKKndi", &kind, &xa, &oa, &n, &threshold, &threads)) return NULL;
    if (n < 0 || kind < SIGMOID || kind > SOFTPLUS) {
        PyErr_Format(PyExc_ValueError, "bad pointwise call: kind=%d n=%zd", kind, n);
        return NULL;
    }
    const float *x = (const float *)xa;
    float *out = (float *)oa;
    const float limit = (float)threshold;
    const int nt = (n < PARALLEL_MIN_ELEMENTS || threads < 1) ? 1 : threads;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (Py_ssize_t i = 0; i < n; i++) {
        const float v = x[i];
        if (kind == SIGMOID) out[i] = 1.0f / (1.0f + expf(-v));
        else if (kind == SILU) out[i] = v / (1.0f + expf(-v));
        else out[i] = v > limit ? v : log1pf(expf(v));
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"apply", apply, METH_VARARGS, "sigmoid / silu / softplus of each float, position-free."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pointwise",
                                    "Position-free element-wise ops (deterministic inference).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__pointwise(void) { return PyModule_Create(&module); }
