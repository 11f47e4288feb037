/* One AMX work item (amx_item.h includes this twice: on the tile registers and on
 * amx_tiles.h's emulation in memory, which tests run on any CPU; both run the same lines).
 *
 * The item: up to two A tiles of 16 rows (tmm0, tmm3) x one or two blocks of 16 columns
 * (B tiles tmm1, tmm2), four C tiles (tmm4 rows 0-15 x block 0, tmm5 x block 1, tmm6 and tmm7
 * rows 16-31); each B tile is 16 packed 64-byte lines of a block (the bodies' weight layout
 * as it is), b0 / b1 the blocks' first lines. C lands in acc, rows 32 values apart (block j
 * of row i at acc + 32 i + 16 j). two / nb are literals at each call. */
AMX_ATTR static inline __attribute__((always_inline)) void AMX_BODY(
    const AMX_A_T *a0, int64_t s0, const AMX_A_T *a1, int64_t s1, const AMX_W_T *b0,
    const AMX_W_T *b1, int64_t k, AMX_ACC_T *acc, const int two, const int nb) {
    TZERO(4);
    TZERO(5);
    TZERO(6);
    TZERO(7);
    for (int64_t q = 0; q < k; q += AMX_K) {
        TLOAD(0, a0 + q, s0);
        TLOAD(1, b0 + q * BLOCK, 64);
        if (nb == 2) TLOAD(2, b1 + q * BLOCK, 64);
        TDP(4, 0, 1);
        if (nb == 2) TDP(5, 0, 2);
        if (two) {
            TLOAD(3, a1 + q, s1);
            TDP(6, 3, 1);
            if (nb == 2) TDP(7, 3, 2);
        }
    }
    TSTORE(4, acc, 2 * BLOCK * 4);
    TSTORE(5, acc + BLOCK, 2 * BLOCK * 4);
    TSTORE(6, acc + AMX_ROWS * 2 * BLOCK, 2 * BLOCK * 4);
    TSTORE(7, acc + AMX_ROWS * 2 * BLOCK + BLOCK, 2 * BLOCK * 4);
}

/* a1 NULL: rows of one A tile only; s0 / s1 their row strides in bytes. w: the packed
 * weights, blk / nb the panel's blocks (2, or 1 in a last odd one), k % AMX_K == 0. */
AMX_ATTR static void AMX_ITEM(const AMX_A_T *a0, int64_t s0, const AMX_A_T *a1, int64_t s1,
                              const AMX_W_T *w, const int64_t blk[2], int nb, int64_t k,
                              AMX_ACC_T *acc) {
    const AMX_W_T *b0 = w + blk[0] * k * BLOCK, *b1 = w + blk[nb - 1] * k * BLOCK;
    if (a1 && nb == 2) AMX_BODY(a0, s0, a1, s1, b0, b1, k, acc, 1, 2);
    else if (a1) AMX_BODY(a0, s0, a1, s1, b0, b1, k, acc, 1, 1);
    else if (nb == 2) AMX_BODY(a0, s0, a1, s1, b0, b1, k, acc, 0, 2);
    else AMX_BODY(a0, s0, a1, s1, b0, b1, k, acc, 0, 1);
}
#undef AMX_ATTR
#undef AMX_BODY
#undef AMX_ITEM
#undef TZERO
#undef TLOAD
#undef TSTORE
#undef TDP
