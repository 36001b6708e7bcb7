// aiter_sage cpu attention, amx tier operand layer: the avx512 tier's (softmax, exp2, P packing,
// BF16 output) with signed Q words, since tdpbssd multiplies signed by signed bytes. The tile
// steps come from amx_tiles.h through attention_tiles.inc.
#define SAGE_CPU_SIGNED_Q_WORDS 1
#include "cpu/simd_avx512.h"
