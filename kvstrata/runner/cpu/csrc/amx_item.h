/* The AMX work item of each AMX body (bf16_gemm_amx.h, int8_gemm_amx.h), compiled twice:
 * amx_item_hw on the tile registers, amx_item_emu on amx_tiles.h's emulation (tests). The
 * includer defines AMX_A_T / AMX_W_T (the rows' and weights' element types), AMX_ACC_T (the
 * sums'), AMX_K (k per tile step: 64 bytes of a row) and TDP_HW / TDP_EMU (its dot product
 * on the registers and emulated); this file undefines all but AMX_K. */
#define AMX_ATTR AMX_TARGET
#define AMX_BODY amx_body_hw
#define AMX_ITEM amx_item_hw
#ifdef KVSTRATA_EMULATE_AVX512 /* the tests' build: the registers' item on emulated tiles */
#define TZERO TZERO_EMU
#define TLOAD TLOAD_EMU
#define TSTORE TSTORE_EMU
#define TDP TDP_EMU
#else
#define TZERO TZERO_HW
#define TLOAD TLOAD_HW
#define TSTORE TSTORE_HW
#define TDP TDP_HW
#endif
#include "amx_item_body.h"
#define AMX_ATTR
#define AMX_BODY amx_body_emu
#define AMX_ITEM amx_item_emu
#define TZERO TZERO_EMU
#define TLOAD TLOAD_EMU
#define TSTORE TSTORE_EMU
#define TDP TDP_EMU
#include "amx_item_body.h"
#undef AMX_A_T
#undef AMX_W_T
#undef AMX_ACC_T
#undef TDP_HW
#undef TDP_EMU
