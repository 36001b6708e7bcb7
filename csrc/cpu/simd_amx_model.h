// aiter_sage cpu attention, amx_model tier operand layer: the portable layer in the amx tier's
// operand shapes (16-row vectors, BF16 P and V); the tile steps run on amx_tiles_model.h.
#define SAGE_CPU_SCALAR_TILE_OPERANDS 1
#include "cpu/simd_scalar.h"
