/* fp32 linear layers for a few rows (a decode step at batch 1-16), included by cpu_ops.c:
 *
 *   gemv_f32(x, x_row_stride, m, k, w, n, bias, out, threads, isa_cap)
 *       out[r][j] = bias[j] + sum_e x[r][e] * W[j][e]  for r < m <= GEMV_MAX_ROWS, out [m][n]
 *
 * w is W ([n][k] fp32) repacked by gemv_pack_f32 into panels of 16 output columns,
 * [n / 16][k][16]: for each e, the 16 columns' weights are one 64-byte line, so a panel is one
 * contiguous stream and each step is two loads and 2m FMAs with m broadcast inputs. Rows go
 * through a panel four at a time (registers); a second group reads the panel from L2.
 *
 * Why: a decode step at batch 1 reads every weight once and does 2 flops per 4 bytes: it is
 * bound by memory bandwidth. oneDNN's prepacked fp32 linear streamed SmolLM2's layer weights at
 * 17-21 GB/s on a 2-vCPU AVX2 EPYC (and slower per byte at 4 rows than at 1) where a plain
 * read of the same bytes ran 26-36 GB/s. Threads take contiguous runs of panels (torch's
 * OpenMP team); the sums run in fp32 in at least four independent chains, so the FMA latency
 * never sets the pace. Results differ from
 * F.linear's by summation order only. AVX2 + FMA (also on AVX-512 machines: the weights'
 * bandwidth, not the vector width, sets the speed); the scalar code computes the same.
 */
#ifndef KVSTRATA_F32_GEMV_H
#define KVSTRATA_F32_GEMV_H

#define GEMV_MAX_ROWS 16 /* f32_gemv.py max_rows() picks 8 or 16 */
#define GEMV_GROUP 4 /* rows a panel pass takes (registers) */
#define GEMV_PANEL 16

static void gemv_panel_scalar(const float *x, int64_t xs, int m, int64_t k, const float *w,
                              float *acc) {
    for (int r = 0; r < m; r++)
        for (int c = 0; c < GEMV_PANEL; c++) acc[r * GEMV_PANEL + c] = 0.f;
    for (int64_t e = 0; e < k; e++)
        for (int r = 0; r < m; r++)
            for (int c = 0; c < GEMV_PANEL; c++)
                acc[r * GEMV_PANEL + c] += x[r * xs + e] * w[e * GEMV_PANEL + c];
}

#if defined(__x86_64__)
/* M rows x one panel; k % 2 == 0. Rows of one or two use two accumulator sets (even e, odd e;
 * summed at the end) for four or eight independent chains; three or four rows have six or
 * eight chains in one set (two sets would need 16+ registers). */
#define GEMV_PANEL_AVX2(M, SETS)                                                            \
    AVX2 static void gemv_panel##M##_avx2(const float *x, int64_t xs, int64_t k,            \
                                          const float *w, float *acc) {                     \
        __m256 a[SETS][M][2];                                                               \
        for (int s = 0; s < SETS; s++)                                                      \
            for (int r = 0; r < M; r++) a[s][r][0] = a[s][r][1] = _mm256_setzero_ps();      \
        for (int64_t e = 0; e < k; e += 2) {                                                \
            for (int h = 0; h < 2; h++) {                                                   \
                const float *we = w + (e + h) * GEMV_PANEL;                                 \
                const __m256 w0 = _mm256_load_ps(we), w1 = _mm256_load_ps(we + 8);          \
                const int s = SETS == 2 ? h : 0;                                            \
                for (int r = 0; r < M; r++) {                                               \
                    const __m256 xb = _mm256_broadcast_ss(x + r * xs + e + h);              \
                    a[s][r][0] = _mm256_fmadd_ps(xb, w0, a[s][r][0]);                       \
                    a[s][r][1] = _mm256_fmadd_ps(xb, w1, a[s][r][1]);                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < M; r++)                                                         \
            for (int c = 0; c < 2; c++)                                                     \
                _mm256_storeu_ps(acc + r * GEMV_PANEL + 8 * c,                              \
                                 SETS == 2 ? _mm256_add_ps(a[0][r][c], a[SETS - 1][r][c])   \
                                           : a[0][r][c]);                                   \
    }
GEMV_PANEL_AVX2(1, 2)
GEMV_PANEL_AVX2(2, 2)
GEMV_PANEL_AVX2(3, 1)
GEMV_PANEL_AVX2(4, 1)
typedef void (*gemv_panel_fn)(const float *, int64_t, int64_t, const float *, float *);
static const gemv_panel_fn GEMV_PANELS[GEMV_GROUP + 1] = {
    NULL, gemv_panel1_avx2, gemv_panel2_avx2, gemv_panel3_avx2, gemv_panel4_avx2};
#endif

static PyObject *gemv_f32(PyObject *self, PyObject *args) {
    unsigned long long x_addr, w_addr, b_addr, o_addr;
    Py_ssize_t xs, m, k, n;
    int threads, isa_cap;
    if (!PyArg_ParseTuple(args, "KnnnKnKKii", &x_addr, &xs, &m, &k, &w_addr, &n, &b_addr,
                          &o_addr, &threads, &isa_cap))
        return NULL;
    if (m < 0 || m > GEMV_MAX_ROWS || k < 2 || k % 2 || n < GEMV_PANEL || n % GEMV_PANEL ||
        xs < k) {
        PyErr_Format(PyExc_ValueError, "gemv_f32: bad shape m=%zd k=%zd n=%zd stride=%zd "
                     "(m <= %d, k even, n %% %d == 0)", m, k, n, xs, GEMV_MAX_ROWS, GEMV_PANEL);
        return NULL;
    }
    if (m == 0) Py_RETURN_NONE;
    const float *x = (const float *)x_addr, *w = (const float *)w_addr;
    const float *bias = (const float *)b_addr;
    float *out = (float *)o_addr;
    const int64_t panels = n / GEMV_PANEL;
    const int vec = use_avx2(8, isa_cap);
    const int nt = thread_count(threads, panels, (int64_t)n * k * 4);
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t p = 0; p < panels; p++) {
        float acc[GEMV_GROUP * GEMV_PANEL];
        const float *wp = w + p * k * GEMV_PANEL;
        for (int64_t r0 = 0; r0 < m; r0 += GEMV_GROUP) { /* later groups: the panel from L2 */
            const int g = m - r0 < GEMV_GROUP ? (int)(m - r0) : GEMV_GROUP;
            const float *xg = x + r0 * xs;
#if defined(__x86_64__)
            if (vec) GEMV_PANELS[g](xg, xs, k, wp, acc);
            else
#endif
                gemv_panel_scalar(xg, xs, g, k, wp, acc);
            for (int r = 0; r < g; r++)
                for (int c = 0; c < GEMV_PANEL; c++) {
                    const int64_t j = p * GEMV_PANEL + c;
                    out[(r0 + r) * n + j] = acc[r * GEMV_PANEL + c] + (bias ? bias[j] : 0.f);
                }
        }
    }
    Py_END_ALLOW_THREADS
    (void)vec;
    Py_RETURN_NONE;
}
#endif
