/* What kvstrata's two AMX GEMM bodies share (bf16_gemm_amx.h on tdpbf16ps, int8_gemm_amx.h on
 * tdpbusd): whether the tiles may run, their one configuration (every tile 16 rows x 64 bytes),
 * the work items' panels, and an emulation of the tiles in memory, so that tests check the
 * items' addressing on CPUs without AMX (amx_item.h is compiled once on each).
 *
 * Linux grants a process the tile data only on request (arch_prctl ARCH_REQ_XCOMP_PERM),
 * asked once per process, and the permitted set (ARCH_GET_XCOMP_PERM) must then hold it;
 * refused, the bodies are not used. Each thread of the OpenMP team
 * loads the configuration on entry to a call's region and releases the tiles on exit. */
#ifndef KVSTRATA_AMX_TILES_H
#define KVSTRATA_AMX_TILES_H
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "gemm_panels.h"
#define KVSTRATA_AMX 1
#define AMX_ROWS 16 /* rows of an A tile */
#define AMX_ITEM_ROWS (2 * AMX_ROWS)
#define AMX_BF16_BIT 22 /* CPUID.(7, 0).EDX: AMX-BF16, AMX-TILE 24, AMX-INT8 25 */
#define AMX_INT8_BIT 25

/* Whether this CPU has AMX-TILE and the feature at CPUID.(7, 0).EDX bit `bit`, and Linux let
 * this process use the tiles. Both are read once (called with the GIL held, on every GEMM
 * call: a cpuid in a VM guest exits to the hypervisor). */
#ifdef KVSTRATA_EMULATE_AVX512 /* the tests' build (isa_emulation.h): tiles in memory */
static int amx_ready(int bit) {
    return kvs_emulated_cpu_supports(bit == AMX_BF16_BIT ? "amx_bf16" : "amx_int8");
}
#else
static int amx_ready(int bit) {
    static int granted = -1;
    static unsigned edx;
    if (granted < 0) {
        unsigned a, b, c, d = 0;
        granted = 0;
        if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24))) {
            edx = d;
            /* the request's answer is not enough: a Firecracker guest (kernel 6.18,
             * 2026-12-07) answered 0 while its supported and permitted sets lacked
             * XTILEDATA, and ldtilecfg then raised SIGILL; the permitted set decides.
             * (uapi asm/prctl.h: 0x1021 GET_XCOMP_SUPP, 0x1022 GET_XCOMP_PERM, 0x1023
             * REQ_XCOMP_PERM, 0x1024 GET_XCOMP_GUEST_PERM -- a KVM guest's set, which read
             * here in error from 2026-12-07 to the next day turned the AMX bodies off on
             * every CPU.) */
            unsigned long perm = 0;
            granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                              18 /* XFEATURE_XTILEDATA */) == 0
                      && syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &perm) == 0
                      && (perm >> 18 & 1);
        }
    }
    return granted && (edx & (1u << bit));
}
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8")))
#ifdef KVSTRATA_EMULATE_AVX512
static void amx_configure(void) {}
static void amx_release(void) {}
#else
AMX_TARGET static void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = AMX_ROWS;
        cfg.colsb[t] = 64;
    }
    /* Not _tile_loadconfig: GCC 12's names only the first 8 bytes of its operand (an "m" of
     * a pointer), so -O3 dropped the colsb / rows stores as dead and ldtilecfg read zeros:
     * #GP, SIGSEGV on the first AMX GEMM (Sapphire Rapids VM, 2026-12-07). The operand here
     * is the whole 64-byte configuration. */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}
AMX_TARGET static void amx_release(void) { _tile_release(); }
#endif

/* The emulation: a thread's eight tiles in memory, each 16 rows x 64 bytes. A body runs on
 * the registers (AMX_HW) or emulated, with the epilogue of its AVX2 or scalar fallback
 * (AMX_EMU) or, where the CPU has AVX-512 (or tests emulate it: isa_emulation.h), its own
 * AVX-512 one (AMX_EMU_512): then only the tile instructions are not the hardware run's. */
enum { AMX_HW = 0, AMX_EMU = 1, AMX_EMU_512 = 2 };
static __thread uint8_t emu_tmm[8][AMX_ROWS][64];
static void emu_load(int t, const void *p, int64_t stride) {
    for (int r = 0; r < AMX_ROWS; r++) memcpy(emu_tmm[t][r], (const char *)p + r * stride, 64);
}
static void emu_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < AMX_ROWS; r++) memcpy((char *)p + r * stride, emu_tmm[t][r], 64);
}
/* The tile ops of amx_item.h's two compilations: on the registers, and emulated. */
#define TZERO_HW(t) _tile_zero(t)
#define TLOAD_HW(t, p, s) _tile_loadd(t, p, s)
#define TSTORE_HW(t, p, s) _tile_stored(t, p, s)
#define TZERO_EMU(t) memset(emu_tmm[t], 0, sizeof emu_tmm[t])
#define TLOAD_EMU(t, p, s) emu_load(t, p, s)
#define TSTORE_EMU(t, p, s) emu_store(t, p, s)

/* Panels of two blocks: plain, blocks 2p and 2p + 1 (a last one may have one); silu, gate
 * block p and its up block nb / 2 + p. */
static inline int64_t amx_panel_count(int64_t n, int silu) {
    const int64_t nb = n / BLOCK;
    return silu ? nb / 2 : (nb + 1) / 2;
}
static inline int amx_panel(int64_t n, int silu, int64_t p, int64_t blk[2]) {
    const int64_t nb = n / BLOCK;
    blk[0] = silu ? p : 2 * p;
    blk[1] = silu ? nb / 2 + p : 2 * p + 1;
    return silu || 2 * p + 1 < nb ? 2 : 1;
}

/* Work item `it` of a call over m rows (items panel-major, nrb blocks of 32 rows): its first
 * row (*r0), its panel's blocks (blk, *nb) and its row count (1-32, returned). */
static inline int amx_item_at(int64_t it, int64_t nrb, int64_t m, int64_t n, int silu,
                              int64_t *r0, int64_t blk[2], int *nb) {
    *r0 = it % nrb * AMX_ITEM_ROWS;
    *nb = amx_panel(n, silu, it / nrb, blk);
    return (int)(m - *r0 < AMX_ITEM_ROWS ? m - *r0 : AMX_ITEM_ROWS);
}
#endif
#endif
