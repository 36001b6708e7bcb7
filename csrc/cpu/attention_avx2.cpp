// aiter_sage cpu attention, AVX2 tier.
#define SAGE_CPU_TARGET "avx2,fma"
#define SAGE_CPU_SIMD_HEADER "cpu/simd_avx2.h"
#define SAGE_CPU_TIER_TABLE kAttentionAvx2
#include "cpu/attention_tier.inc"
