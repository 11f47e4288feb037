/* Deterministic inference's decode rows in the prefill kernel's summation order (included by
 * paged_decode.c, used by decode(..., fixed=1)).
 *
 * Why: under --enable-deterministic-inference a query must come out bit-identical whether it
 * is a prompt row (many rows of one prompt in one call, keys just written) or a decode row
 * (one row, keys read back from the pool). The decode kernel's order -- every score a
 * 16-lane dot product reduced across lanes, one softmax over all keys, fp32 V sums -- has no
 * form that shares a key's loads and sums across a tile of query rows (each score still needs
 * its own horizontal reduction), so a prompt run in that order paid it per token: bf16
 * served 0.55x with the flag on an AVX-512 BF16 EPYC. The prefill kernel's order (key blocks
 * of PF_BK = 64 anchored at position 0, each row's scores over the block summed along d in
 * one order, an online-softmax merge per block, one rounding of the output) depends on a
 * row's position, query, keys and values only: not on the other rows of its item, how many
 * there are, the prefix read from the pool or the threads. So under the flag a decode row
 * runs as a one-row prompt of that kernel (block (q_lo = b, nq = 1, prefix = its keys - 1)),
 * and the prompt rows run the prefill kernel itself: the same function of the same inputs.
 *
 * Needs q and the pool of one dtype (fp32 or bf16; the prefill kernel reads both as one) and
 * no softmax extras (sinks, soft-capping: their layers keep the decode kernel's order). */
#ifndef KVSTRATA_DECODE_FIXED_H
#define KVSTRATA_DECODE_FIXED_H

/* n one-row "prompts": row b attends to the keys at slots[starts[b] .. ends[b]) (ends NULL:
 * starts[b + 1]). 0, or -1 when out of memory. *isa: the body it ran. */
static int decode_fixed(const char *q, int64_t q_stride, const char *k, const char *v,
                        const int64_t *slots, const int64_t *starts, const int64_t *ends,
                        int64_t n, int64_t hq, int64_t hkv, int64_t d, int bf16, float scale,
                        char *out, int threads, int isa_cap, int *isa) {
    pf_block *blk = malloc((size_t)(n > 0 ? n : 1) * sizeof(pf_block));
    if (!blk) return -1;
    int64_t nblocks = 0;
    for (int64_t b = 0; b < n; b++) {
        const int64_t len = (ends ? ends[b] : starts[b + 1]) - starts[b];
        if (len == 0) { /* no keys: zeros, as the decode kernel writes */
            memset(out + b * hq * d * (bf16 ? 2 : 4), 0, (size_t)(hq * d * (bf16 ? 2 : 4)));
            continue;
        }
        blk[nblocks++] = (pf_block){b, 0, 1, starts[b], len - 1, len};
    }
    pf_job j = {q, k, v, out, slots, hq, hkv, d, q_stride, hkv * d, hkv * d, bf16, 0, 0,
                scale};
    j.vec = pf_pick_isa(d, isa_cap);
    j.dp = pfb_supported(j.vec, j.bf16);
    *isa = j.vec;
    const int failed = pf_run(&j, blk, nblocks, threads);
    free(blk);
    return failed;
}
#endif
