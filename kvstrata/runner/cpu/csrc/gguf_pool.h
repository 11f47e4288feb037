/* The packed GGUF calls' own worker threads (gguf_ops.c, gguf_q8_run.h), instead of an OpenMP
 * team per call.
 *
 * Why: a batch-1 decode step makes ~90 packed calls big enough to split (SmolLM2: qkv,
 * gate|up and down of 30 layers, and the head). An OpenMP region ends in a barrier that waits
 * for every thread of the team, so when the second vCPU is busy with another process (the
 * API server, the detokenizer, a neighbour) each call waits until the scheduler gives its
 * worker a time slice again: on a shared 2-vCPU box the same server ran batch-1 TPOT 152 ms
 * with two threads and 21.7 ms with one (docs/benchmarks.md). And libgomp's idle workers spin
 * for milliseconds after each region, so between steps they keep a vCPU from those processes.
 *
 * Here a call is cut into chunks that any thread may claim (one atomic word: generation << 32
 * | next chunk); the caller claims chunks too, and returns once every chunk is done. It never
 * waits for a worker that has not started: a worker that wakes late finds nothing left. It
 * waits only for chunks a worker already took (a few microseconds of work each). Workers spin
 * for POOL_SPIN_US after their last chunk (a decode step's calls come every few tens of
 * microseconds), then sleep on a condition variable until the next call.
 *
 * Which thread computes a chunk never changes its bits: each output is computed whole, in one
 * order, by whichever thread claims its chunk (the kernels' batch invariance).
 *
 *   pool_run(fn, job, chunks, threads, rows): fn(job, c, worker) for every c in [0, chunks),
 *       on the caller (worker 0) and up to threads - 1 pool workers (1..threads-1, started on
 *       first use), for a call of up to POOL_MAX_ROWS rows; else on torch's OpenMP team
 *       (static split); a worker index < threads addresses per-thread scratch.
 */
#ifndef KVSTRATA_GGUF_POOL_H
#define KVSTRATA_GGUF_POOL_H
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#define POOL_PAUSE() _mm_pause()
#else
#define POOL_PAUSE() ((void)0)
#endif

#define POOL_MAX_THREADS 64
#define POOL_SPIN_US 300 /* a worker's wait for the next call before it sleeps */

typedef void (*pool_fn)(const void *job, int64_t chunk, int worker);

typedef struct {
    _Alignas(64) _Atomic uint64_t claim; /* generation << 32 | next unclaimed chunk */
    _Alignas(64) _Atomic int64_t done;   /* chunks finished of this generation */
    _Alignas(64) _Atomic(pool_fn) fn;    /* this generation's call: fn, job, chunks, threads */
    _Atomic(const void *) job;
    _Atomic int64_t chunks;
    _Atomic int threads;
    _Atomic int sleepers;
    _Atomic int workers; /* started: indices 1..workers */
    _Atomic int64_t chunks_called, chunks_run; /* since start: every chunk runs exactly once */
    _Atomic pid_t pid;   /* the process that started them (a fork's child has none) */
    pthread_mutex_t lock;
    pthread_cond_t wake;
} pool_state;

static pool_state pool_g = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};
static pthread_mutex_t pool_start_lock = PTHREAD_MUTEX_INITIALIZER;
/* One call at a time (the calls release the GIL: a second Python thread waits its turn). */
static pthread_mutex_t pool_call_lock = PTHREAD_MUTEX_INITIALIZER;

/* The stress test's windows (tests/correctness/test_gguf_pool_stress.py, _gguf_ops.pool_delays;
 * 0 otherwise: one relaxed load per chunk): a worker pauses after each chunk it finishes, as
 * a descheduled worker would, and the caller pauses between publishing a call's fields and
 * its claim word. Together they open, on every call, the window in which a late worker of the
 * last call could read this call's fields under the old claim (the race fixed in pool_run). */
static _Atomic int pool_test_worker_us = 0, pool_test_caller_us = 0;

static void pool_test_pause(_Atomic int *us) {
    const int wait = atomic_load_explicit(us, memory_order_relaxed);
    if (wait > 0) usleep((useconds_t)wait);
}

/* Claim and run chunks of generation gen until none is left (or a newer call replaced it).
 * The call's fields are read before the claim's compare-and-swap: a call replaced in between
 * fails the swap (its generation moved), so a chunk always runs with its own call's fields. */
static void pool_drain(const uint32_t gen, const int worker) {
    for (;;) {
        uint64_t c = atomic_load_explicit(&pool_g.claim, memory_order_acquire);
        if ((uint32_t)(c >> 32) != gen) return;
        const pool_fn fn = atomic_load_explicit(&pool_g.fn, memory_order_relaxed);
        const void *job = atomic_load_explicit(&pool_g.job, memory_order_relaxed);
        const int64_t chunks = atomic_load_explicit(&pool_g.chunks, memory_order_relaxed);
        const int threads = atomic_load_explicit(&pool_g.threads, memory_order_relaxed);
        const int64_t k = (int64_t)(c & 0xffffffffu);
        if (k >= chunks || worker >= threads) return;
        if (!atomic_compare_exchange_weak_explicit(&pool_g.claim, &c, c + 1,
                                                   memory_order_acq_rel, memory_order_relaxed))
            continue;
        fn(job, k, worker);
        atomic_fetch_add_explicit(&pool_g.chunks_run, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool_g.done, 1, memory_order_release);
        if (worker) pool_test_pause(&pool_test_worker_us);
    }
}

static int64_t pool_now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000 + t.tv_nsec / 1000;
}

static void *pool_worker(void *arg) {
    const int worker = (int)(intptr_t)arg;
#ifdef __linux__
    prctl(PR_SET_NAME, "kvstrata-gguf"); /* in top -H and /proc/<pid>/task/<tid>/comm */
#endif
    uint32_t seen = (uint32_t)(atomic_load(&pool_g.claim) >> 32);
    int64_t idle_since = pool_now_us();
    for (unsigned spins = 0;; spins++) {
        const uint32_t gen = (uint32_t)(atomic_load_explicit(&pool_g.claim,
                                                             memory_order_acquire) >> 32);
        if (gen != seen) {
            seen = gen;
            if (worker < atomic_load_explicit(&pool_g.threads, memory_order_relaxed)) {
                pool_drain(gen, worker);
                idle_since = pool_now_us(); /* a call of ours: the next may follow soon */
                spins = 0;
            }
            continue;
        }
        POOL_PAUSE();
        if ((spins & 255) != 255 || pool_now_us() - idle_since < POOL_SPIN_US) continue;
        /* Sleep until a newer generation. sleepers and claim are both seq_cst: either the
         * caller sees this sleeper (and signals under the lock), or this sees its call. */
        pthread_mutex_lock(&pool_g.lock);
        atomic_fetch_add(&pool_g.sleepers, 1);
        while ((uint32_t)(atomic_load(&pool_g.claim) >> 32) == seen)
            pthread_cond_wait(&pool_g.wake, &pool_g.lock);
        atomic_fetch_sub(&pool_g.sleepers, 1);
        pthread_mutex_unlock(&pool_g.lock);
    }
    return NULL;
}

/* Workers 1..threads-1 started (in this process); returns how many threads may run a call:
 * fewer if a thread could not be started. */
static int pool_start(int threads) {
    if (threads > POOL_MAX_THREADS) threads = POOL_MAX_THREADS;
    const pid_t pid = getpid();
    pthread_mutex_lock(&pool_start_lock);
    if (pool_g.pid != pid) { /* a fork's child: its parent's workers are not here, and a
                              * lock one of them held was copied held */
        pool_g.pid = pid;
        pool_g.workers = 0;
        atomic_store(&pool_g.sleepers, 0);
        pthread_mutex_init(&pool_g.lock, NULL);
        pthread_cond_init(&pool_g.wake, NULL);
        pthread_mutex_init(&pool_call_lock, NULL);
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* workers take no signals: Python's thread does */
    while (pool_g.workers < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&t, &attr, pool_worker,
                                          (void *)(intptr_t)(pool_g.workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool_g.workers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    const int usable = pool_g.workers + 1 < threads ? pool_g.workers + 1 : threads;
    pthread_mutex_unlock(&pool_start_lock);
    return usable;
}


/* 0: the calls split their chunks statically over torch's OpenMP team instead, as before the
 * pool (_gguf_ops.use_pool(False): KVSTRATA_CPU_GGUF_POOL=0, an ablation). */
static _Atomic int pool_enabled = 1;

/* Calls of more rows than this split over torch's OpenMP team as before: a step that large
 * runs other OpenMP regions too (decode attention over 1 MiB of K and V, silu * up over 14+
 * rows of 1536), after which libgomp's workers spin for milliseconds; pool workers spinning
 * beside them would leave three busy threads on two cores. */
#define POOL_MAX_ROWS 4

static void pool_run(pool_fn fn, const void *job, int64_t chunks, int threads, int64_t rows) {
    if (!atomic_load_explicit(&pool_enabled, memory_order_relaxed) || rows > POOL_MAX_ROWS) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && chunks > 1)
        for (int64_t c = 0; c < chunks; c++) fn(job, c, omp_get_thread_num());
#else
        for (int64_t c = 0; c < chunks; c++) fn(job, c, 0);
#endif
        return;
    }
    if (threads > 1 && chunks > 1 &&
        (atomic_load(&pool_g.pid) != getpid() || atomic_load(&pool_g.workers) + 1 < threads))
        threads = pool_start(threads);
    if (threads <= 1 || chunks <= 1) {
        for (int64_t c = 0; c < chunks; c++) fn(job, c, 0);
        return;
    }
    pthread_mutex_lock(&pool_call_lock);
    /* Close the last call's generation before its fields change: a worker still in
     * pool_drain holds that generation's claim word (its last index, all chunks taken) and,
     * reading this call's larger `chunks`, took a chunk of this call under the old
     * generation, counted it in `done` after the reset below, and let the caller return
     * while a chunk still ran on the caller's finished job: SIGSEGV in a worker, whose
     * signals are blocked, so the scheduler died without a traceback (SmolLM2 Q8_0 kept
     * packed, batch 1: 2 servers of 3, 2026-12-07). The closed generation's index takes
     * nothing; workers that see it drain nothing and wait for the next. */
    const uint32_t last = (uint32_t)(atomic_load(&pool_g.claim) >> 32);
    atomic_store(&pool_g.claim, (uint64_t)(last + 1) << 32 | 0xffffffffu);
    atomic_store_explicit(&pool_g.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool_g.job, job, memory_order_relaxed);
    atomic_store_explicit(&pool_g.chunks, chunks, memory_order_relaxed);
    atomic_store_explicit(&pool_g.threads, threads, memory_order_relaxed);
    atomic_store_explicit(&pool_g.done, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool_g.chunks_called, chunks, memory_order_relaxed);
    pool_test_pause(&pool_test_caller_us);
    const uint32_t gen = last + 2;
    atomic_store(&pool_g.claim, (uint64_t)gen << 32); /* seq_cst: publishes the fields */
    if (atomic_load(&pool_g.sleepers) > 0) {
        pthread_mutex_lock(&pool_g.lock);
        pthread_cond_broadcast(&pool_g.wake);
        pthread_mutex_unlock(&pool_g.lock);
    }
    pool_drain(gen, 0);
    /* every chunk claimed: wait for the ones workers are still computing */
    for (unsigned spins = 1; atomic_load_explicit(&pool_g.done, memory_order_acquire) < chunks;
         spins++) {
        POOL_PAUSE();
        if (!(spins & 4095)) sched_yield();
    }
    pthread_mutex_unlock(&pool_call_lock);
}
/* A GEMM call's chunks: blocks of `row_block` rows x ranges of `per` column quads, row block
 * by row block (a block's activations stay in L2 while the threads sweep its quads). */
typedef struct {
    int64_t m, row_block, quads, per, quad_chunks;
} pool_grid;

#define POOL_CHUNKS_PER_THREAD 4       /* at least: a late worker leaves the caller work */
#define POOL_CHUNK_WORK (128 << 10)    /* at most, weight bytes x rows: a chunk a worker holds
                                        * when descheduled costs the caller that much wait */

static pool_grid pool_grid_of(int64_t m, int64_t row_block, int64_t quads, int64_t quad_bytes,
                              int threads) {
    const int64_t rows = m < row_block ? (m > 0 ? m : 1) : row_block;
    int64_t per = (quads + POOL_CHUNKS_PER_THREAD * threads - 1) /
                  (POOL_CHUNKS_PER_THREAD * threads);
    const int64_t cap = POOL_CHUNK_WORK / (quad_bytes * rows > 0 ? quad_bytes * rows : 1);
    if (threads <= 1) per = quads; /* one thread: the whole block in one go */
    else if (per > cap) per = cap;
    if (per < 1) per = 1;
    pool_grid g = {m, row_block, quads, per, (quads + per - 1) / per};
    return g;
}

static int64_t pool_grid_chunks(const pool_grid *g) {
    return (g->m + g->row_block - 1) / g->row_block * g->quad_chunks;
}

/* Chunk c's rows [*r0, *r1) and quads [*q0, *q1). */
static void pool_grid_at(const pool_grid *g, int64_t c, int64_t *r0, int64_t *r1, int64_t *q0,
                         int64_t *q1) {
    const int64_t block = c / g->quad_chunks, part = c % g->quad_chunks;
    *r0 = block * g->row_block;
    *r1 = *r0 + g->row_block < g->m ? *r0 + g->row_block : g->m;
    *q0 = part * g->per;
    *q1 = *q0 + g->per < g->quads ? *q0 + g->per : g->quads;
}
#endif
