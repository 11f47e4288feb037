/* argmax_rows(x, x_row_stride, rows, n, out, threads, isa_cap), included by cpu_ops.c:
 *     out[r] = the first index of the largest of x[r, :n] (fp32; int64 out), as torch.max(dim)
 *     returns it: ties go to the lowest index, and a row holding NaN gives its first NaN.
 *
 * Why: every greedy decode step takes the argmax of [batch, vocab] fp32 logits. torch's
 * max(dim=-1) over SmolLM2's [32, 49152] measured 0.43-0.9 ms a step on 2 threads, ~4% of a
 * w8a8 step, for 6 MB that stream in ~0.2 ms; this pass 0.12-0.13 ms. Per lane the best value
 * and its first index (strictly greater replaces), then the lowest index among the lanes
 * holding the row's maximum; NaN seen anywhere sends the row to the scalar path, which finds
 * it first. */
#ifndef KVSTRATA_ARGMAX_ROWS_H
#define KVSTRATA_ARGMAX_ROWS_H

static int64_t argmax_row_scalar(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i])) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

#if defined(__x86_64__)
AVX512 static int64_t argmax_row_avx512(const float *x, int64_t n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_i = _mm512_setzero_si512();
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, gt, v);
        best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
        idx = _mm512_add_epi32(idx, step);
    }
    if (nan) return argmax_row_scalar(x, n);
    const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)),
                                             _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(top, best_i);
}

/* The same on AVX2 (8 lanes; the last n % 8 elements one by one: their indices are above
 * every lane's, so only a strictly greater one wins). The scalar loop's NaN test and branch
 * per element ran at ~2 GB/s: 3.4 ms of a 119 ms fp32 step at [32, 49152] on an AVX2 EPYC. */
AVX2 static int64_t argmax_row_avx2(const float *x, int64_t n) {
    __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    __m256i best_i = _mm256_setzero_si256();
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
        best = _mm256_blendv_ps(best, v, gt);
        best_i = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_i),
                                                      _mm256_castsi256_ps(idx), gt));
        idx = _mm256_add_epi32(idx, step);
    }
    if (_mm256_movemask_ps(nan)) return argmax_row_scalar(x, n);
    float lane_v[8];
    int32_t lane_i[8];
    _mm256_storeu_ps(lane_v, best);
    _mm256_storeu_si256((__m256i *)lane_i, best_i);
    float top = lane_v[0];
    int64_t top_i = lane_i[0];
    for (int l = 1; l < 8; l++)
        if (lane_v[l] > top || (lane_v[l] == top && lane_i[l] < top_i)) {
            top = lane_v[l];
            top_i = lane_i[l];
        }
    for (; i < n; i++) {
        if (isnan(x[i])) return i;  /* no NaN before: the vector part had none */
        if (x[i] > top) { top = x[i]; top_i = i; }
    }
    return top_i;
}
#endif

static PyObject *argmax_rows(PyObject *self, PyObject *args) {
    unsigned long long x_addr, o_addr;
    Py_ssize_t stride, rows, n;
    int threads, isa_cap;
    if (!PyArg_ParseTuple(args, "KnnnKii", &x_addr, &stride, &rows, &n, &o_addr, &threads,
                          &isa_cap))
        return NULL;
    if (rows < 0 || n < 1 || n > INT32_MAX || stride < n) {
        PyErr_Format(PyExc_ValueError, "bad shape: rows=%zd n=%zd stride=%zd", rows, n, stride);
        return NULL;
    }
    const float *x = (const float *)x_addr;
    int64_t *out = (int64_t *)o_addr;
    const int vec = use_avx512(16, isa_cap); /* any n: the last block is masked */
    const int vec2 = !vec && use_avx2(8, isa_cap); /* any n: the tail is scalar */
    const int nt = thread_count(threads, rows, (int64_t)rows * n * 4);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (Py_ssize_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (vec) { out[r] = argmax_row_avx512(x + r * stride, n); continue; }
        if (vec2) { out[r] = argmax_row_avx2(x + r * stride, n); continue; }
#endif
        out[r] = argmax_row_scalar(x + r * stride, n);
    }
    Py_END_ALLOW_THREADS
    (void)vec; (void)vec2;
    Py_RETURN_NONE;
}
#endif
