// aiter_sage cpu attention, amx tier: Q.K^T on AMX-INT8 (tdpbssd), P.V on AMX-BF16
// (tdpbf16ps), the softmax and epilogue on AVX-512 (the avx512 tier's operand layer). Picked
// only where cpu_runtime.cpp found AMX and the OS granted the tile data permission. The tile
// instructions are inline asm (amx_tiles.h), so the target string needs no AMX flag.
#define SAGE_CPU_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16"
#define SAGE_CPU_SIMD_HEADER "cpu/simd_amx.h"
#define SAGE_CPU_TILE_HEADER "cpu/amx_tiles.h"
#define SAGE_CPU_BLOCK_Q 256
#define SAGE_CPU_TILE_K 256
#define SAGE_CPU_STRIP_ROWS 32
#define SAGE_CPU_TIER_TABLE kAttentionAmx
#include "cpu/attention_tier.inc"
