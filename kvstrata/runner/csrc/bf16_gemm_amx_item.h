/* One AMX work item of bf16_gemm_amx.h, included twice by it: once on the tile registers
 * (AMX_ITEM amx_item_hw, the T* macros the AMX intrinsics) and once on an emulation of them
 * in memory (amx_item_emu), which the tests run on any CPU so that the item's addressing is
 * checked where no AMX exists; the real tiles run the same lines.
 *
 * The item: up to two A tiles of 16 rows (tmm0, tmm3) x one or two blocks of 16 columns
 * (B tiles tmm1, tmm2), four fp32 C tiles (tmm4 rows 0-15 x block 0, tmm5 x block 1, tmm6 and
 * tmm7 rows 16-31), k in steps of 32 (16 pairs: one 64-byte A row per row, 16 packed lines
 * of a block per B tile, which is bf16_gemm.c's layout as it is). C lands in acc, rows 32
 * floats apart (block j of row i at acc + 32 i + 16 j). two / nb are literals at each call. */
AMX_ATTR static ALWAYS_INLINE void AMX_BODY(const gemm_args *g, const uint16_t *a0, int64_t s0,
                                            const uint16_t *a1, int64_t s1,
                                            const int64_t blk[2], float *acc, const int two,
                                            const int nb) {
    const uint16_t *b0 = g->w + blk[0] * g->k * BLOCK, *b1 = g->w + blk[nb - 1] * g->k * BLOCK;
    TZERO(4);
    TZERO(5);
    TZERO(6);
    TZERO(7);
    for (int64_t q = 0; q < g->k; q += AMX_K) {
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

/* a1 NULL: rows of one A tile only. nb: the panel's blocks (2, or 1 in a last odd one). */
AMX_ATTR static void AMX_ITEM(const gemm_args *g, const uint16_t *a0, int64_t s0,
                              const uint16_t *a1, int64_t s1, const int64_t blk[2], int nb,
                              float *acc) {
    if (a1 && nb == 2) AMX_BODY(g, a0, s0, a1, s1, blk, acc, 1, 2);
    else if (a1) AMX_BODY(g, a0, s0, a1, s1, blk, acc, 1, 1);
    else if (nb == 2) AMX_BODY(g, a0, s0, a1, s1, blk, acc, 0, 2);
    else AMX_BODY(g, a0, s0, a1, s1, blk, acc, 0, 1);
}
#undef AMX_ATTR
#undef AMX_BODY
#undef AMX_ITEM
#undef TZERO
#undef TLOAD
#undef TSTORE
#undef TDP
