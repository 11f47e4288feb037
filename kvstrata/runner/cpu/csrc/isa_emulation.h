/* The x86 instruction sets the kernels use beyond AVX2 (AVX-512 F, BW, DQ, VL, VNNI, BF16;
 * AMX-BF16 / AMX-INT8), emulated for the tests on CPUs without them. Only a build with
 * KVSTRATA_EMULATE_AVX512 defined includes this file (tests/helpers/emulated_isa.py compiles
 * the kernel extensions so, with -mavx2 -mfma -mf16c): SIMDe's headers (PyPI simde-py) stand in
 * for <immintrin.h>'s AVX-512 half, the kernels' target attributes are dropped (KVS_TARGET),
 * and __builtin_cpu_supports answers for the CPU that KVSTRATA_EMULATED_CPU_FLAGS names (its
 * /proc/cpuinfo flags, e.g. "avx512f avx512bw avx512_vnni": a Cascade Lake; emulated_isa.py's
 * install() sets the default, AVX-512 with VNNI and BF16, when it is unset), so one build
 * runs the bodies and the dispatch of each CPU generation on any AVX2 machine, slowly,
 * against the same torch references as the real ones. With amx_bf16 / amx_int8 named,
 * amx_tiles.h grants those and the AMX bodies' items run on its tiles emulated in memory.
 *
 * Where SIMDe 0.8.2 lacks an intrinsic the kernels use, or sums in another order than the
 * hardware, it is written here: the sums in the order GCC's headers and Intel's pseudo-code
 * give, so results match the real instructions bit for bit. */
#ifndef KVSTRATA_ISA_EMULATION_H
#define KVSTRATA_ISA_EMULATION_H
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

/* ---- the CPU's answer ------------------------------------------------------------------- */
/* Whether the emulated CPU has `feature` (GCC's spelling, "avx512vnni", or the flags' own,
 * "avx512_vnni": underscores are skipped on both sides). AVX2, FMA and F16C: always (the
 * build's own). */
static inline int kvs_emulated_cpu_supports(const char *feature) {
    if (!strcmp(feature, "avx2") || !strcmp(feature, "fma") || !strcmp(feature, "f16c"))
        return 1;
    const char *flags = getenv("KVSTRATA_EMULATED_CPU_FLAGS");
    if (!flags) return 0; /* nothing named: AVX2 alone */
    for (const char *p = flags; *p;) {
        while (*p == ' ') p++;
        const char *f = feature;
        for (;;) {
            while (*p == '_') p++;
            while (*f == '_') f++;
            if (!*p || *p == ' ' || *p != *f) break;
            p++, f++;
        }
        if ((!*p || *p == ' ') && !*f) return 1;
        while (*p && *p != ' ') p++;
    }
    return 0;
}

#define __builtin_cpu_init() ((void)0)
#define __builtin_cpu_supports(feature) kvs_emulated_cpu_supports(feature)

/* ---- intrinsics SIMDe lacks -------------------------------------------------------------- */
static inline float kvs_emu_reduce_add_ps(__m512 a) { /* GCC's tree: halves, quarters, pairs */
    float v[16], t[8], u[4];
    _mm512_storeu_ps(v, a);
    for (int i = 0; i < 8; i++) t[i] = v[8 + i] + v[i];
    for (int i = 0; i < 4; i++) u[i] = t[4 + i] + t[i];
    return (u[0] + u[2]) + (u[1] + u[3]);
}
#define _mm512_reduce_add_ps(a) kvs_emu_reduce_add_ps(a)

static inline int kvs_emu_mask_reduce_min_epi32(__mmask16 k, __m512i a) {
    int32_t v[16];
    int best = INT_MAX;
    _mm512_storeu_si512(v, a);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1 && v[i] < best) best = v[i];
    return best;
}
#define _mm512_mask_reduce_min_epi32(k, a) kvs_emu_mask_reduce_min_epi32(k, a)

static inline __m256i kvs_emu_cvtepi32_epi16(__m512i a) { /* truncating */
    int32_t v[16];
    int16_t r[16];
    _mm512_storeu_si512(v, a);
    for (int i = 0; i < 16; i++) r[i] = (int16_t)v[i];
    return _mm256_loadu_si256((const __m256i *)r);
}
#define _mm512_cvtepi32_epi16(a) kvs_emu_cvtepi32_epi16(a)

static inline __m128i kvs_emu_cvtepi32_epi8(__m512i a) { /* truncating */
    int32_t v[16];
    int8_t r[16];
    _mm512_storeu_si512(v, a);
    for (int i = 0; i < 16; i++) r[i] = (int8_t)v[i];
    return _mm_loadu_si128((const __m128i *)r);
}
#define _mm512_cvtepi32_epi8(a) kvs_emu_cvtepi32_epi8(a)

static inline __m512 kvs_emu_permute_ps(__m512 a, int imm) { /* within each 128-bit lane */
    float v[16], r[16];
    _mm512_storeu_ps(v, a);
    for (int i = 0; i < 16; i++) r[i] = v[(i & ~3) + ((imm >> (2 * (i & 3))) & 3)];
    return _mm512_loadu_ps(r);
}
#define _mm512_permute_ps(a, imm) kvs_emu_permute_ps(a, imm)

static inline uint16_t kvs_emu_bf16_rne(float f) { /* vcvtne2ps2bf16: nearest even, NaN quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline __m512bh kvs_emu_cvtne2ps_pbh(__m512 hi, __m512 lo) { /* lo -> lanes 0-15 */
    float h[16], l[16];
    uint16_t r[32];
    __m512bh out;
    _mm512_storeu_ps(h, hi);
    _mm512_storeu_ps(l, lo);
    for (int i = 0; i < 16; i++) {
        r[i] = kvs_emu_bf16_rne(l[i]);
        r[16 + i] = kvs_emu_bf16_rne(h[i]);
    }
    memcpy(&out, r, sizeof out);
    return out;
}
#define _mm512_cvtne2ps_pbh(hi, lo) kvs_emu_cvtne2ps_pbh(hi, lo)

/* vdpbf16ps adds a lane's odd pair first, then its even pair (Intel's pseudo-code); SIMDe
 * adds the even one first (and one lane at a time). A pair's halves as fp32: the odd bf16 is
 * the dword's top half already, the even one shifted up; their products are exact in fp32,
 * so each add rounds once, as the instruction's. */
static inline __m512 kvs_emu_dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
    __m512i x, y;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    const __m512 x_odd = _mm512_castsi512_ps(_mm512_and_si512(x, top));
    const __m512 y_odd = _mm512_castsi512_ps(_mm512_and_si512(y, top));
    const __m512 x_even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    const __m512 y_even = _mm512_castsi512_ps(_mm512_slli_epi32(y, 16));
    src = _mm512_add_ps(src, _mm512_mul_ps(x_odd, y_odd));
    return _mm512_add_ps(src, _mm512_mul_ps(x_even, y_even));
}
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) kvs_emu_dpbf16_ps(src, a, b)

#endif
