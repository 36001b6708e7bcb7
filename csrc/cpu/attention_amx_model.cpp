// aiter_sage cpu attention, amx_model tier: the amx tier's kernel code (attention_tiles.inc,
// same block sizes) on a C++ model of the tile instructions (amx_tiles_model.h) and portable
// operands. Slow; runs anywhere; selected only by AITER_SAGE_CPU_ISA=amx_model, so that CI
// exercises the amx tier's tile steps on machines without AMX.
#define SAGE_CPU_SIMD_HEADER "cpu/simd_amx_model.h"
#define SAGE_CPU_TILE_HEADER "cpu/amx_tiles_model.h"
#define SAGE_CPU_BLOCK_Q 256
#define SAGE_CPU_TILE_K 256
#define SAGE_CPU_STRIP_ROWS 32
#define SAGE_CPU_TIER_TABLE kAttentionAmxModel
#include "cpu/attention_tier.inc"
