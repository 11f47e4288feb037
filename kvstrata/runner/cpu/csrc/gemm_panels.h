/* The work layout kvstrata's two GEMMs share (int8_gemm.h on vpdpbusd, bf16_gemm.c on
 * vdpbf16ps): output columns in blocks of BLOCK (one zmm), register tiles of up to MR rows x
 * NR blocks, a "panel" being the NR blocks one tile multiplies. Weights are packed per block,
 * each k step of a block one 64-byte line, so both kernels also share how a tile prefetches
 * its thread's next panel. */
#ifndef KVSTRATA_GEMM_PANELS_H
#define KVSTRATA_GEMM_PANELS_H
#include <stdint.h>

#define MR 4
#define NR 4
#define BLOCK 16 /* output columns per block */

/* Panels of n output columns: plain panels are NR consecutive blocks; silu panels (a fused
 * gate|up projection) pair NR / 2 gate blocks with the up blocks of the same columns. */
static inline int64_t panel_count(int64_t n, int silu) {
    const int64_t nb = n / BLOCK, per = silu ? NR / 2 : NR;
    return ((silu ? nb / 2 : nb) + per - 1) / per;
}

/* The blocks of panel p and how many there are (a last panel may have fewer): plain, up to
 * NR consecutive blocks; silu, up to NR / 2 gate blocks then their up blocks (the up half
 * starts at block nb / 2). */
static inline int panel_blocks(int64_t n, int silu, int64_t p, int64_t blk[NR]) {
    const int64_t nb = n / BLOCK;
    if (!silu) {
        const int nr = (int)(nb - p * NR < NR ? nb - p * NR : NR);
        for (int j = 0; j < nr; j++) blk[j] = p * NR + j;
        return nr;
    }
    const int64_t half = nb / 2, per = NR / 2;
    const int ng = (int)(half - p * per < per ? half - p * per : per);
    for (int j = 0; j < ng; j++) {
        blk[j] = p * per + j;
        blk[ng + j] = half + blk[j];
    }
    return 2 * ng;
}

/* What a tile prefetches of the panel its thread multiplies next: row block rb of nrb takes
 * every nrb-th 64-byte line of that panel's blocks, one per k step, so the panel streams in
 * from RAM while this one's rows multiply from cache (without it the first row block of each
 * panel waited on RAM while the cores idled, and the rest ran from cache while RAM idled).
 * Measured, the 120 GEMMs of a SmolLM2 decode step at 32 rows: bf16 16.1-16.7 -> 12.1-12.6
 * ms, int8 7.6-7.9 -> 6.3-6.9 ms (with the int8 GEMM's narrower tail tiles). */
/* Rows of another buffer a GEMM brings into the caches while it multiplies (a decode step's
 * next KV layer, runner/models/decode_plan.py): one 64-byte line every k step, the
 * thread's share of the slots in order, each slot's K row then its V row (row_bytes each).
 * A compute-bound GEMM leaves RAM idle; decode attention waits on it (from RAM it ran at
 * about twice its time from the L3 cache, which keeps lines the L2 evicts). */
typedef struct {
    const char *k, *v;
    const int64_t *slots;
    int64_t row_bytes, s, s_end, line; /* the next slot and byte of its K then V row */
} side_rows;

typedef struct {
    const char *w[NR];
    int nr;
    int64_t next, every; /* the next k step whose line is due, then every this many */
    int64_t ahead; /* AVX2 bf16, few rows: instead, the current block this many k steps on */
    side_rows *side; /* or NULL */
} prefetch_plan;

/* Slots [s, s_end) of `job` for thread t of nt (an even split). */
static inline side_rows side_share(const side_rows *job, int t, int nt) {
    side_rows r = *job;
    const int64_t n = job->s_end - job->s;
    r.s = job->s + n * t / nt;
    r.s_end = job->s + n * (t + 1) / nt;
    r.line = 0;
    return r;
}

static inline void side_step(side_rows *r) {
    if (r->s >= r->s_end) return;
    const int64_t row = r->slots[r->s] * r->row_bytes, b = r->line;
    __builtin_prefetch(b < r->row_bytes ? r->k + row + b : r->v + row + b - r->row_bytes, 0, 2);
    r->line += 64;
    if (r->line >= 2 * r->row_bytes) {
        r->line = 0;
        r->s++;
    }
}

/* The plan of the tile at row block rb of nrb in panel p (blocks of block_bytes from w). */
static inline prefetch_plan plan_next_panel(const char *w, int64_t block_bytes, int64_t n,
                                            int silu, int64_t p, int64_t rb, int64_t nrb) {
    prefetch_plan pf = {{NULL}, 0, rb, nrb};
    if (p + 1 < panel_count(n, silu)) {
        int64_t blk[NR] = {0}; /* (set by panel_blocks; gcc cannot tell) */
        pf.nr = panel_blocks(n, silu, p + 1, blk);
        for (int j = 0; j < pf.nr; j++) pf.w[j] = w + blk[j] * block_bytes;
    } else {
        pf.next = INT64_MAX;
    }
    return pf;
}

/* Called at every k step of a tile: the plan's lines due at this step. */
static inline void prefetch_due(prefetch_plan *pf, int64_t step) {
    if (pf->side) side_step(pf->side);
    if (step != pf->next) return;
    for (int j = 0; j < pf->nr; j++) __builtin_prefetch(pf->w[j] + step * 64, 0, 2);
    pf->next += pf->every;
}
#endif
