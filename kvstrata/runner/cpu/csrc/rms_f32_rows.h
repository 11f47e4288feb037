/* fp32 RMSNorm rows, included by cpu_ops.c (after its AVX2 hsum8):
 *   rms_norm_f32(x, x_row_stride, rows, h, w, out, eps, threads, isa_cap)
 *       out[r] = w * (x[r] * (1 / sqrt(sum(x[r]^2) / h + eps)))    (HF's fp32 RMSNorm)
 *   add_rms_norm_f32(x, y, rows, h, w, out, eps, threads, isa_cap)
 *       x[r] += y[r] in place, then out[r] = rms_norm(x[r]) as above (contiguous [rows, h])
 *
 * Why: float32 is what --dtype auto serves on a CPU without bf16 instructions, and there
 * torch's rms_norm cost ~50 us a call inside a SmolLM2 decode step (61 a step: ~3 ms of a
 * 45 ms batch-1 step, ~7 ms of a 146 ms batch-32 step on an AVX2 EPYC), mostly waking its
 * thread team for a few KB; these rows stay on the caller's thread below
 * PARALLEL_MIN_BYTES. The products round as torch's do (built with -ffp-contract=off); only
 * the order of the sum of squares differs (vector lanes, then across them).
 */
#ifndef KVSTRATA_RMS_F32_ROWS_H
#define KVSTRATA_RMS_F32_ROWS_H

/* `y` NULL: no residual add (as the vector rows below) */
static void rms_row_f32_scalar(float *x, const float *y, const float *w, float *o, int64_t h,
                               float eps) {
    float ss = 0.f;
    for (int64_t i = 0; i < h; i++) {
        if (y) x[i] += y[i];
        ss += x[i] * x[i];
    }
    const float r = 1.f / sqrtf(ss / (float)h + eps);
    for (int64_t i = 0; i < h; i++) o[i] = w[i] * (x[i] * r);
}

#if defined(__x86_64__)
/* h % 16 == 0; `y` NULL: no residual add */
AVX512 static void rms_row_f32_avx512(float *x, const float *y, const float *w, float *o,
                                      int64_t h, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        if (y) { v = _mm512_add_ps(v, _mm512_loadu_ps(y + i)); _mm512_storeu_ps(x + i, v); }
        ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
    }
    const __m512 r = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)h + eps));
    for (int64_t i = 0; i < h; i += 16)
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(w + i),
                                              _mm512_mul_ps(_mm512_loadu_ps(x + i), r)));
}
/* h % 8 == 0 */
AVX2 static void rms_row_f32_avx2(float *x, const float *y, const float *w, float *o, int64_t h,
                                  float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < h; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (y) { v = _mm256_add_ps(v, _mm256_loadu_ps(y + i)); _mm256_storeu_ps(x + i, v); }
        ss = _mm256_add_ps(ss, _mm256_mul_ps(v, v));
    }
    const __m256 r = _mm256_set1_ps(1.f / sqrtf(hsum8(ss) / (float)h + eps));
    for (int64_t i = 0; i < h; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                              _mm256_mul_ps(_mm256_loadu_ps(x + i), r)));
}
#endif

/* Both entry points: add != 0 reads y and updates x in place (x rows then contiguous). */
static PyObject *rms_rows_f32(PyObject *args, int add) {
    unsigned long long x_addr, y_addr = 0, w_addr, o_addr;
    Py_ssize_t stride, rows, h;
    double eps;
    int threads, isa_cap;
    if (add ? !PyArg_ParseTuple(args, "KKnnKKdii", &x_addr, &y_addr, &rows, &h, &w_addr,
                                &o_addr, &eps, &threads, &isa_cap)
            : !PyArg_ParseTuple(args, "KnnnKKdii", &x_addr, &stride, &rows, &h, &w_addr,
                                &o_addr, &eps, &threads, &isa_cap))
        return NULL;
    if (add) stride = h;
    if (rows < 0 || h < 1 || stride < h) {
        PyErr_Format(PyExc_ValueError, "bad shape: rows=%zd h=%zd stride=%zd", rows, h, stride);
        return NULL;
    }
    float *x = (float *)x_addr, *o = (float *)o_addr;
    const float *y = (const float *)y_addr, *w = (const float *)w_addr;
    const int vec = use_avx512(h, isa_cap), vec8 = !vec && use_avx2(h, isa_cap);
    const int nt = thread_count(threads, rows, (int64_t)rows * h * (add ? 16 : 8));
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (Py_ssize_t r = 0; r < rows; r++) {
        float *xr = x + r * stride, *orow = o + r * h;
        const float *yr = add ? y + r * h : NULL;
#if defined(__x86_64__)
        if (vec) { rms_row_f32_avx512(xr, yr, w, orow, h, (float)eps); continue; }
        if (vec8) { rms_row_f32_avx2(xr, yr, w, orow, h, (float)eps); continue; }
#endif
        rms_row_f32_scalar(xr, yr, w, orow, h, (float)eps);
    }
    Py_END_ALLOW_THREADS
    (void)vec;
    (void)vec8;
    Py_RETURN_NONE;
}
static PyObject *rms_norm_f32(PyObject *self, PyObject *args) { return rms_rows_f32(args, 0); }
static PyObject *add_rms_norm_f32(PyObject *self, PyObject *args) { return rms_rows_f32(args, 1); }
#endif
