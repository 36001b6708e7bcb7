// aiter_sage cpu prepare, AVX2 tier.
#define SAGE_CPU_TARGET "avx2,fma"
#define SAGE_CPU_TIER_TABLE kPrepareAvx2
#include "cpu/prepare_tier.inc"
