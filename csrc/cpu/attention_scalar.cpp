// aiter_sage cpu attention, portable tier: no target attributes
// (runs on any host; the compiler may still use the baseline SIMD, e.g. SSE2).
#define SAGE_CPU_SIMD_HEADER "cpu/simd_scalar.h"
#define SAGE_CPU_TIER_TABLE kAttentionScalar
#include "cpu/attention_tier.inc"
