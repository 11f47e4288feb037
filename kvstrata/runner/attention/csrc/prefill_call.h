/* paged_decode.c's prefill entry points: prefill(...) -- a prompt's query blocks over its
 * keys in the pool (prefill_attention.h's kernel, blocks costliest first over the OpenMP
 * team) -- and prefill_isa(d, cap), the body it picks. Included by paged_decode.c after
 * prefill_attention.h, beside the decode entry. */
#ifndef KVSTRATA_PREFILL_CALL_H
#define KVSTRATA_PREFILL_CALL_H

static int pf_block_cmp(const void *a, const void *b) { /* costliest (most keys) first */
    const int64_t ca = ((const pf_block *)a)->cost, cb = ((const pf_block *)b)->cost;
    return ca < cb ? 1 : (ca > cb ? -1 : 0);
}

/* The prefill kernel's vector code for head size d on this CPU, at most `cap`. */
static int pf_pick_isa(int64_t d, int cap) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (cap >= ISA_AVX512 && d % 64 == 0 && avx2 && __builtin_cpu_supports("avx512f"))
        return ISA_AVX512;
    if (cap >= ISA_AVX2 && d % 32 == 0 && avx2) return ISA_AVX2;
#else
    (void)d; (void)cap;
#endif
    return ISA_SCALAR;
}

/* Every (block, KV head) item of j over the OpenMP team (dynamically scheduled: causal blocks
 * differ in cost), the GIL released: 0, or -1 when a thread's scratch was out of memory. The
 * prefill entry and decode_fixed.h's decode rows share it. */
static int pf_run(const pf_job *j, const pf_block *blk, int64_t nblocks, int threads) {
    const int64_t items = nblocks * j->hkv;
#ifndef _OPENMP
    threads = 1;
#endif
    if (threads > items) threads = items > 0 ? (int)items : 1;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads) reduction(| : failed) if (threads > 1)
    {
        pf_scratch sc;
        int bad = pf_scratch_alloc(&sc, j);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++)
            if (!bad) pf_item(j, &sc, blk + it / j->hkv, it % j->hkv);
        pf_scratch_free(&sc);
        failed |= bad != 0;
    }
    Py_END_ALLOW_THREADS
    return failed ? -1 : 0;
}

static PyObject *prefill(PyObject *self, PyObject *args) {
    unsigned long long q_addr, k_addr, v_addr, slots_addr, seqs_addr, out_addr;
    Py_ssize_t q_stride, q_rows, pool_rows, n_slots, n_seqs, hq, hkv, d;
    double scale;
    int dtype, num_threads, isa_cap;
    if (!PyArg_ParseTuple(args, "KnnKKnKnKnnnnidKii", &q_addr, &q_stride, &q_rows, &k_addr,
                          &v_addr, &pool_rows, &slots_addr, &n_slots, &seqs_addr, &n_seqs, &hq,
                          &hkv, &d, &dtype, &scale, &out_addr, &num_threads, &isa_cap))
        return NULL;
    if (n_seqs < 0 || hq < 1 || hkv < 1 || d < 1 || d > PF_MAX_D || hq % hkv ||
        (dtype != KV_F32 && dtype != KV_BF16) || q_stride < hq * d) {
        PyErr_Format(PyExc_ValueError, "prefill: bad shape or dtype (hq=%zd hkv=%zd d=%zd "
                     "dtype=%d)", hq, hkv, d, dtype);
        return NULL;
    }
    const int64_t *slots = (const int64_t *)slots_addr, *seqs = (const int64_t *)seqs_addr;
    for (Py_ssize_t i = 0; i < n_slots; i++)
        if (slots[i] < 0 || slots[i] >= pool_rows) {
            PyErr_Format(PyExc_IndexError, "slot %lld outside the pool (%zd rows)",
                         (long long)slots[i], pool_rows);
            return NULL;
        }
    int64_t nblocks = 0;
    for (Py_ssize_t s = 0; s < n_seqs; s++) {
        const int64_t *e = seqs + 4 * s;
        if (e[0] < 0 || e[1] < e[0] || e[1] > q_rows || e[2] < 0 || e[3] < 0 ||
            e[2] + e[3] + e[1] - e[0] > n_slots) {
            PyErr_SetString(PyExc_IndexError, "prefill: a prompt's rows or slots are out of range");
            return NULL;
        }
        nblocks += (e[1] - e[0] + PF_BQ - 1) / PF_BQ;
    }
    pf_block *blk = malloc((size_t)(nblocks > 0 ? nblocks : 1) * sizeof(pf_block));
    if (!blk) return PyErr_NoMemory();
    for (Py_ssize_t s = 0, i = 0; s < n_seqs; s++) {
        const int64_t *e = seqs + 4 * s;
        for (int64_t q0 = 0; q0 < e[1] - e[0]; q0 += PF_BQ, i++) {
            const int64_t left = e[1] - e[0] - q0;
            blk[i] = (pf_block){e[0], q0, left < PF_BQ ? left : PF_BQ, e[2], e[3],
                                e[3] + q0 + PF_BQ};
        }
    }
    qsort(blk, (size_t)nblocks, sizeof(pf_block), pf_block_cmp);
    pf_job j = {(const char *)q_addr, (const char *)k_addr, (const char *)v_addr,
                (char *)out_addr, slots, hq, hkv, d, q_stride, hkv * d, hkv * d,
                dtype == KV_BF16, 0, 0, (float)scale};
    j.vec = pf_pick_isa(d, isa_cap);
    j.dp = pfb_supported(j.vec, j.bf16);
    const int threads = num_threads < 1 ? 1 : (num_threads > MAX_THREADS ? MAX_THREADS
                                                                          : num_threads);
    const int failed = pf_run(&j, blk, nblocks, threads);
    free(blk);
    if (failed) return PyErr_NoMemory();
    return PyUnicode_FromString(ISA_NAMES[j.vec]);
}

static PyObject *prefill_isa(PyObject *self, PyObject *args) {
    Py_ssize_t d;
    int isa_cap;
    if (!PyArg_ParseTuple(args, "ni", &d, &isa_cap)) return NULL;
    return PyUnicode_FromString(ISA_NAMES[d >= 1 && d <= PF_MAX_D ? pf_pick_isa(d, isa_cap) : 0]);
}

#endif
