/* The shared-memory all-reduce step of kvstrata/runner/parallel/shm_allreduce.py, included by
 * cpu_ops.c (it uses that file's dtype enum and use_avx512). */
#ifndef KVSTRATA_SHM_ALLREDUCE_H
#define KVSTRATA_SHM_ALLREDUCE_H
#include <sched.h>

/* ---- shared-memory all-reduce (kvstrata/runner/parallel/shm_allreduce.py) ---------------
 *   shm_all_reduce(base, header, slot_bytes, rank, size, seq, t, numel, dtype, published,
 *                  max_spins) -> 1 done | 0 still waiting
 * The layout and protocol are the module's: a flag per rank every 64 bytes from `base`, then
 * two buffers of `size` slots. Unless `published`, copies t into this rank's slot of buffer
 * seq % 2 and stores the flag (release); then spins (pause, then sched_yield) up to
 * `max_spins` times until every flag reached seq (acquire loads) and, when they have, sums
 * the slots in rank order in fp32 into t (bf16: rounded once at the end, as torch's
 * fp32 accumulator copied back) -- the same bits on every rank. Returning 0 lets the caller
 * check its abort reason and timeout, then call again with published=1. */
#if defined(__x86_64__)
AVX512 static void sum_slots_avx512(char *const *src, int64_t size, void *t, int64_t numel,
                                    int dtype) {
    for (int64_t i = 0; i < numel; i += 16) {
        __m512 acc = dtype == F32 ? _mm512_loadu_ps((const float *)src[0] + i)
                                  : bf16x16_load((const uint16_t *)src[0] + i);
        for (int64_t r = 1; r < size; r++)
            acc = _mm512_add_ps(acc, dtype == F32 ? _mm512_loadu_ps((const float *)src[r] + i)
                                                  : bf16x16_load((const uint16_t *)src[r] + i));
        if (dtype == F32) _mm512_storeu_ps((float *)t + i, acc);
        else _mm256_storeu_si256((__m256i *)((uint16_t *)t + i), bf16x16_from(acc));
    }
}
#endif
static void sum_slots(char *const *src, int64_t size, void *t, int64_t numel, int dtype,
                      int isa_cap) {
    int64_t head = 0;
#if defined(__x86_64__)
    if (use_avx512(16, isa_cap)) {
        head = numel - numel % 16;
        sum_slots_avx512(src, size, t, head, dtype);
    }
#else
    (void)isa_cap;
#endif
    for (int64_t i = head; i < numel; i++) {
        float acc = dtype == F32 ? ((const float *)src[0])[i]
                                 : bf16_to_f32(((const uint16_t *)src[0])[i]);
        for (int64_t r = 1; r < size; r++)
            acc += dtype == F32 ? ((const float *)src[r])[i]
                                : bf16_to_f32(((const uint16_t *)src[r])[i]);
        if (dtype == F32) ((float *)t)[i] = acc;
        else ((uint16_t *)t)[i] = f32_to_bf16(acc);
    }
}

#define SHM_MAX_RANKS 64
#define SHM_SPINS_BEFORE_YIELD 200
static PyObject *shm_all_reduce(PyObject *self, PyObject *args) {
    unsigned long long base_addr, t_addr;
    Py_ssize_t header, slot_bytes, rank, size, numel;
    long long seq;
    int dtype, published, max_spins, isa_cap;
    if (!PyArg_ParseTuple(args, "KnnnnLKniiii", &base_addr, &header, &slot_bytes, &rank, &size,
                          &seq, &t_addr, &numel, &dtype, &published, &max_spins, &isa_cap))
        return NULL;
    const int64_t esz = dtype == F32 ? 4 : 2;
    if ((dtype != F32 && dtype != BF16) || size < 1 || size > SHM_MAX_RANKS || rank < 0 ||
        rank >= size || numel < 0 || numel * esz > slot_bytes || header < 64 * size) {
        PyErr_Format(PyExc_ValueError, "shm_all_reduce: bad arguments (rank %zd of %zd, %zd "
                     "elements of dtype %d, slot %zd bytes)", rank, size, numel, dtype,
                     slot_bytes);
        return NULL;
    }
    char *base = (char *)base_addr;
    char *src[SHM_MAX_RANKS];
    for (int64_t r = 0; r < size; r++)
        src[r] = base + header + ((seq % 2) * size + r) * slot_bytes;
    int done = 0;
    Py_BEGIN_ALLOW_THREADS
    if (!published) {
        memcpy(src[rank], (const void *)t_addr, (size_t)(numel * esz));
        __atomic_store_n((int64_t *)(base + 64 * rank), (int64_t)seq, __ATOMIC_RELEASE);
    }
    for (int spin = 0; spin < max_spins && !done; spin++) {
        done = 1;
        for (int64_t r = 0; r < size && done; r++)
            done = __atomic_load_n((int64_t *)(base + 64 * r), __ATOMIC_ACQUIRE) >= seq;
        if (!done) {
            if (spin >= SHM_SPINS_BEFORE_YIELD) sched_yield();
#if defined(__x86_64__)
            else __builtin_ia32_pause();
#endif
        }
    }
    if (done) sum_slots(src, size, (void *)t_addr, numel, dtype, isa_cap);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(done);
}

#endif
