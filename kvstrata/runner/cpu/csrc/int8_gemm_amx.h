/* int8_gemm.h's GEMM on AMX-INT8 tiles (Sapphire / Emerald / Granite Rapids Xeons), an A/B
 * for now (KVSTRATA_CPU_INT8_GEMM=amx; not measured on an AMX machine yet): the same
 * quantised rows and packed weights, the same epilogue, the products on the tile registers.
 *
 * Why: bf16_gemm_amx.h's tiles took a bf16 decode step's GEMMs at 32 rows from 15.7 to
 * 10.3 ms and at 128 rows from 47.1 to 11.7 ms on 16 cores of an H200 host's Xeon
 * (2026-12-04); one tdpbusd is 16 x 16 x 64 multiply-adds of u8 x s8, 16x a vpdpbusd, and
 * the int8 tile there (5.6 ms at 32 rows, 41.1 at 512) was bound by its instructions.
 *
 * How: the VNNI layout ([k / 4][16][4] per block of 16 columns) is an AMX B tile as it is
 * (16 lines of 64 bytes: 64 k); A tiles read the u8 codes quant_rows writes, 16 rows of 64
 * bytes, the rows padded to a multiple of 16 with code 128 (as the VNNI tile pads to 4);
 * k % 64 == 0. Items of up to 32 rows x two blocks (amx_item.h), the int32 sums stored to
 * the item's buffer, then row_out_vnni (int8_gemm.h) per row: tdpbusd sums exactly as
 * vpdpbusd does, so the outputs equal the VNNI tile's bit for bit. The emulated tiles
 * (tests, any CPU) run row_out_vnni where the VNNI tile runs, else the scalar tile's
 * epilogue: equal too. Calls of up to 4 rows stay on the VNNI tile (one row block: the
 * weights stream once either way). */
#ifndef KVSTRATA_INT8_GEMM_AMX_H
#define KVSTRATA_INT8_GEMM_AMX_H
#include "amx_tiles.h"
#ifdef KVSTRATA_AMX
#define AMX_K 64 /* k per tile step: 64 u8 codes of a row */

/* tdpbusd as its definition reads: int32 sums of u8 x s8 products, 4 per k quadruple. */
static void emu_dp_int8(int c, int a, int b) {
    for (int m = 0; m < AMX_ROWS; m++)
        for (int n = 0; n < 16; n++) {
            int32_t acc;
            memcpy(&acc, &emu_tmm[c][m][4 * n], 4);
            for (int kk = 0; kk < 16; kk++)
                for (int t = 0; t < 4; t++)
                    acc += (int32_t)emu_tmm[a][m][4 * kk + t] *
                           (int32_t)(int8_t)emu_tmm[b][kk][4 * n + t];
            memcpy(&emu_tmm[c][m][4 * n], &acc, 4);
        }
}

#define AMX_A_T uint8_t
#define AMX_W_T int8_t
#define AMX_ACC_T int32_t
#define TDP_HW(c, a, b) _tile_dpbusd(c, a, b)
#define TDP_EMU(c, a, b) emu_dp_int8(c, a, b)
#include "amx_item.h"

/* The item's rows out of its sums (acc: rows 32 values apart): on the tiles, row_out_vnni
 * (emulated too where the VNNI tile runs: AMX_EMU_512); else the scalar tile's epilogue over
 * each 4 rows, its sums laid out as that tile's (silu: the gate block in slot 0, its up block
 * in slot NR / 2). */
VNNI512 static void amx_rows_out_512(const gemm_args *g, int64_t r0, int rows,
                                     const int64_t blk[2], int nb, const int32_t *acc) {
    int64_t b4[NR] = {blk[0], blk[nb - 1], blk[0], blk[nb - 1]};
    for (int i = 0; i < rows; i++) {
        __m512i c[2];
        c[0] = _mm512_loadu_si512((const void *)(acc + i * 2 * BLOCK));
        c[1] = _mm512_loadu_si512((const void *)(acc + i * 2 * BLOCK + BLOCK));
        if (nb == 2) row_out_vnni(g, r0 + i, b4, c, 2);
        else row_out_vnni(g, r0 + i, b4, c, 1);
    }
}
static void amx_rows_out_scalar(const gemm_args *g, int64_t r0, int rows,
                                const int64_t blk[2], int nb, const int32_t *acc) {
    int64_t b4[NR] = {blk[0], blk[nb - 1], blk[0], blk[nb - 1]};
    int valid = nb;
    if (g->silu) { /* gate in slot 0, up in slot NR / 2 */
        b4[NR / 2] = blk[1];
        valid = 1;
    }
    for (int i0 = 0; i0 < rows; i0 += MR) {
        int32_t a4[MR][NR * BLOCK];
        memset(a4, 0, sizeof a4);
        for (int i = 0; i < MR && i0 + i < rows; i++)
            for (int j = 0; j < nb; j++) {
                const int slot = g->silu && j == 1 ? NR / 2 : j;
                memcpy(a4[i] + slot * BLOCK, acc + (i0 + i) * 2 * BLOCK + j * BLOCK,
                       sizeof(int32_t) * BLOCK);
            }
        gemm_args part = *g;
        part.m = r0 + rows; /* the epilogue stops at the item's last row */
        tile_epilogue(&part, a4, r0 + i0, b4, valid);
    }
}

/* The tiles of one thread's share, inside linear's OpenMP region after quantisation: g->a
 * holds ceil(m / 16) * 16 rows. mode: amx_tiles.h's AMX_HW, AMX_EMU or AMX_EMU_512. */
static void amx_gemm_tiles(const gemm_args *g, int mode) {
    const int emulate = mode != AMX_HW;
    const int64_t nrb = (g->m + AMX_ITEM_ROWS - 1) / AMX_ITEM_ROWS, k = g->k;
    const int64_t items = amx_panel_count(g->n, g->silu) * nrb;
    int32_t acc[AMX_ITEM_ROWS * 2 * BLOCK] __attribute__((aligned(64)));
    if (!emulate) amx_configure();
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; it++) {
        int64_t r0, blk[2];
        int nb;
        const int valid = amx_item_at(it, nrb, g->m, g->n, g->silu, &r0, blk, &nb);
        const uint8_t *a0 = g->a + r0 * k, *a1 = valid > AMX_ROWS ? a0 + AMX_ROWS * k : NULL;
        if (emulate) amx_item_emu(a0, k, a1, k, g->w, blk, nb, k, acc);
        else amx_item_hw(a0, k, a1, k, g->w, blk, nb, k, acc);
        if (mode == AMX_EMU) amx_rows_out_scalar(g, r0, valid, blk, nb, acc);
        else amx_rows_out_512(g, r0, valid, blk, nb, acc);
    }
    if (!emulate) amx_release();
}
#endif
#endif
